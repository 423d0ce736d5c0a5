//! `settle: { usage: PRESET }`: a route resource's cost settled from the
//! token counts an LLM API reports in its answer, as a count of tokens or,
//! with a price, as money.
//!
//! ```yaml
//! resources:
//!   - { resource: llm-tokens, cost: 1500, settle: { usage: openai } }
//!   - { resource: llm-output, cost: 500, settle: { usage: anthropic, tokens: output } }
//!   - { resource: llm-usd, cost: 0.05,
//!       settle: { usage: openai, price: { input_per_million: 0.15, output_per_million: 0.60 } } }
//! ```
//!
//! A preset names where its API puts the counts, in a JSON answer and in a
//! stream of server-sent events; `usher_enforce::settle` reads them. This
//! module holds the rule and reads it from the routes file.

use std::fmt;

use super::yaml::{Checker, MapView, Node, closest};

/// How a cost is settled from an LLM API's token counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UsageRule {
    /// Whose answers: where the counts are.
    pub api: UsageApi,
    /// Which tokens count.
    pub tokens: Tokens,
    /// What a million tokens cost: the settled cost is money, not tokens.
    pub price: Option<Price>,
}

/// An LLM API whose answers carry token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageApi {
    /// OpenAI's Chat Completions and Responses APIs (and servers that speak them).
    OpenAi,
    /// Anthropic's Messages API.
    Anthropic,
}

/// Which of an answer's tokens a cost counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tokens {
    /// Input and output.
    #[default]
    Total,
    /// The prompt's tokens.
    Input,
    /// The generated tokens.
    Output,
}

/// The price of a million tokens on each side (in whatever currency the
/// resource counts).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    /// A million input tokens.
    pub input_per_million: f64,
    /// A million output tokens.
    pub output_per_million: f64,
}

/// The presets' names, as written in a routes file.
const APIS: [&str; 2] = ["openai", "anthropic"];
/// The `tokens:` values.
const TOKENS: [&str; 3] = ["total", "input", "output"];
/// The fields of `price:`.
const PRICE_FIELDS: [&str; 2] = ["input_per_million", "output_per_million"];

impl UsageRule {
    /// The cost of an answer that used `input` and `output` tokens (`total`
    /// as the answer says, else their sum); `None` when a count it needs is
    /// missing.
    pub fn cost(&self, input: Option<f64>, output: Option<f64>, total: Option<f64>) -> Option<f64> {
        let per = |n: f64, price: f64| n * price / 1e6;
        match (self.tokens, self.price) {
            (Tokens::Input, None) => input,
            (Tokens::Output, None) => output,
            (Tokens::Total, None) => total.or_else(|| Some(input? + output?)),
            (Tokens::Input, Some(p)) => Some(per(input?, p.input_per_million)),
            (Tokens::Output, Some(p)) => Some(per(output?, p.output_per_million)),
            (Tokens::Total, Some(p)) => Some(per(input?, p.input_per_million) + per(output?, p.output_per_million)),
        }
    }
}

impl fmt::Display for UsageApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UsageApi::OpenAi => "openai",
            UsageApi::Anthropic => "anthropic",
        })
    }
}

impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tokens::Total => "total",
            Tokens::Input => "input",
            Tokens::Output => "output",
        })
    }
}

/// `usage (openai, total tokens, at 0.15 per million input tokens and 0.6 per million output tokens)`.
impl fmt::Display for UsageRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "usage ({}, {} tokens", self.api, self.tokens)?;
        if let Some(p) = &self.price {
            let (i, o) = (p.input_per_million, p.output_per_million);
            match self.tokens {
                Tokens::Input => write!(f, ", at {i} per million")?,
                Tokens::Output => write!(f, ", at {o} per million")?,
                Tokens::Total => write!(f, ", at {i} per million input tokens and {o} per million output tokens")?,
            }
        }
        f.write_str(")")
    }
}

/// Reads `usage:` (given at `node`) with the `tokens:` and `price:` of the
/// same `settle:` mapping `m`. Every problem is reported; `None` then.
pub(crate) fn read(ck: &mut Checker, m: &MapView<'_>, node: &Node) -> Option<UsageRule> {
    let field = m.child("usage");
    let name = ck.string(node, &field)?;
    let api = match name.as_str() {
        "openai" => Some(UsageApi::OpenAi),
        "anthropic" => Some(UsageApi::Anthropic),
        _ => {
            let hint = closest(&name.to_ascii_lowercase(), &APIS)
                .map_or_else(|| format!("one of {}", APIS.join(", ")), |c| format!("did you mean `{c}`?"));
            ck.error(node.loc, &field, format!("unknown usage preset `{name}`"), Some(hint));
            None
        }
    };
    let tokens = match m.get("tokens") {
        None => Some(Tokens::Total),
        Some(n) => read_tokens(ck, m, n),
    };
    let price = match m.get("price") {
        None => Some(None),
        Some(n) => read_price(ck, &m.child("price"), n, tokens.unwrap_or_default()).map(Some),
    };
    Some(UsageRule { api: api?, tokens: tokens?, price: price? })
}

fn read_tokens(ck: &mut Checker, m: &MapView<'_>, n: &Node) -> Option<Tokens> {
    let field = m.child("tokens");
    match ck.string(n, &field)?.as_str() {
        "total" => Some(Tokens::Total),
        "input" => Some(Tokens::Input),
        "output" => Some(Tokens::Output),
        other => {
            let hint = format!("one of {}: which of the answer's tokens the cost counts", TOKENS.join(", "));
            ck.error(n.loc, &field, format!("expected input, output or total, not `{other}`"), Some(hint));
            None
        }
    }
}

/// Reads `price:`: the sides `tokens` counts must be priced, at 0 or more.
fn read_price(ck: &mut Checker, path: &str, node: &Node, tokens: Tokens) -> Option<Price> {
    let pm = ck.map(node, path, &PRICE_FIELDS)?;
    // A misspelt side was reported as unknown: not again as missing.
    let mut ok = pm.entries().all(|(k, _)| k.as_str().is_some_and(|k| PRICE_FIELDS.contains(&k)));
    let mut side = |ck: &mut Checker, key: &str, needed: bool| -> f64 {
        let Some(n) = pm.get(key) else {
            if needed && ok {
                ck.error(
                    pm.loc(),
                    &pm.child(key),
                    format!("missing required field: tokens: {tokens} counts these tokens"),
                    Some("a price of 0 for tokens that are free".into()),
                );
                ok = false;
            }
            return 0.0;
        };
        match ck.f64(n, &pm.child(key)) {
            Some(v) if v.is_finite() && v >= 0.0 => v,
            Some(v) => {
                ck.error(n.loc, &pm.child(key), format!("must be a number of at least 0, not {v}"), None);
                ok = false;
                0.0
            }
            None => {
                ok = false;
                0.0
            }
        }
    };
    let input_per_million = side(ck, "input_per_million", tokens != Tokens::Output);
    let output_per_million = side(ck, "output_per_million", tokens != Tokens::Input);
    ok.then_some(Price { input_per_million, output_per_million })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cost_counts_the_tokens_named_at_their_price() {
        let rule = |tokens, price| UsageRule { api: UsageApi::OpenAi, tokens, price };
        let price = Some(Price { input_per_million: 0.15, output_per_million: 0.6 });
        let (i, o, t) = (Some(1000.0), Some(500.0), Some(1500.0));
        assert_eq!(rule(Tokens::Total, None).cost(i, o, t), Some(1500.0));
        assert_eq!(rule(Tokens::Total, None).cost(i, o, None), Some(1500.0), "a total that is not given is the sum");
        assert_eq!(rule(Tokens::Total, None).cost(None, None, t), Some(1500.0));
        assert_eq!(rule(Tokens::Total, None).cost(i, None, None), None);
        assert_eq!(rule(Tokens::Input, None).cost(i, o, t), Some(1000.0));
        assert_eq!(rule(Tokens::Output, None).cost(i, o, t), Some(500.0));
        assert_eq!(rule(Tokens::Output, None).cost(i, None, t), None);
        let usd = rule(Tokens::Total, price).cost(i, o, t).unwrap();
        assert!((usd - (1000.0 * 0.15 + 500.0 * 0.6) / 1e6).abs() < 1e-15, "{usd}");
        assert_eq!(rule(Tokens::Total, price).cost(None, None, t), None, "a total alone cannot be priced");
        let out = rule(Tokens::Output, price).cost(None, o, None).unwrap();
        assert!((out - 0.0003).abs() < 1e-15, "{out}");
    }
}

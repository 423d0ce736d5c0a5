//! Which API a route leads to, when usher can tell: its own answers on such
//! a route (a 429, a 502) take that API's error shape, so the API's SDK in
//! the app reads them as it reads the API's own, and its exception carries
//! usher's message. [`RoutesConfig::api_dialect`] is the one place that
//! decides it.

use super::{BodyCost, LlmApi, RouteConfig, RoutesConfig, SettleFrom};

/// The error shape of an API usher knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiDialect {
    /// OpenAI's: `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic's: `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl From<LlmApi> for ApiDialect {
    fn from(api: LlmApi) -> Self {
        match api {
            LlmApi::OpenAi => ApiDialect::OpenAi,
            LlmApi::Anthropic => ApiDialect::Anthropic,
        }
    }
}

impl RoutesConfig {
    /// The API `route` leads to, judged from what its resources read: a
    /// cost settled from an API's usage (`settle: { usage: openai }`) or
    /// estimated from its request (`cost: { estimate: anthropic }`), or an
    /// `upstream_quota` preset of OpenAI's (`openai-*`) or Anthropic's
    /// (`anthropic-*`) headers. The first resource that names one decides;
    /// `None` (problem+json) for any other route.
    pub fn api_dialect(&self, route: &RouteConfig) -> Option<ApiDialect> {
        route.resources.iter().find_map(|(name, _)| {
            if let Some(rule) = route.cost_rules.get(name) {
                let estimated = match &rule.body {
                    Some(BodyCost::Estimate(e)) => Some(e.api),
                    _ => None,
                };
                let settled = match &rule.settle {
                    Some(SettleFrom::Usage(u)) => Some(u.api),
                    _ => None,
                };
                if let Some(api) = estimated.or(settled) {
                    return Some(api.into());
                }
            }
            let preset = &self.resources.get(name)?.upstream_quota.as_ref()?.source;
            if preset.starts_with("openai-") {
                Some(ApiDialect::OpenAi)
            } else if preset.starts_with("anthropic-") {
                Some(ApiDialect::Anthropic)
            } else {
                None
            }
        })
    }
}

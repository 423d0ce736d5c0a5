//! `usher check FILE...`: validates routes files, resources files and
//! simulation scenarios, telling them apart by content, and prints every
//! error with its `file:line:column`, what was expected, and a hint.

use std::path::PathBuf;

use crate::config::ConfigError;
use crate::config::resources::ResourcesConfig;
use crate::config::routes::RoutesConfig;
use crate::config::yaml::{Node, Value, parse};
use crate::error::RunError;
use crate::sim::Scenario;

#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// Routes files (sidecar), resources files (capacity server) or sim scenarios.
    #[arg(value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,
}

/// What a file is, judged by its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Routes,
    Resources,
    Scenario,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Routes => "routes file",
            Kind::Resources => "resources file",
            Kind::Scenario => "sim scenario",
        }
    }
}

fn has_key<'a>(root: &'a Node, key: &str) -> Option<&'a Node> {
    match &root.value {
        Value::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
        _ => None,
    }
}

/// Tells the kind of a parsed file from its top-level keys.
pub fn classify(root: &Node) -> Option<Kind> {
    if has_key(root, "clients_per_leaf").is_some() || has_key(root, "tree").is_some() {
        return Some(Kind::Scenario);
    }
    if let Some(r) = has_key(root, "resources")
        && matches!(r.value, Value::Seq(_))
    {
        return Some(Kind::Resources);
    }
    ["routes", "upstreams", "listen", "doorman", "resources"]
        .iter()
        .any(|k| has_key(root, k).is_some())
        .then_some(Kind::Routes)
}

/// Checks one file: its kind, or every error found.
pub fn check_file(path: &std::path::Path) -> Result<Kind, ConfigError> {
    let name = path.display().to_string();
    let text = crate::config::file::read_config(path, "it")?;
    let root = parse(&name, &text)?;
    let kind = classify(&root).ok_or_else(|| {
        let mut e = ConfigError::whole_file(&name, "cannot tell what kind of file this is");
        e.diagnostics[0].hint = Some(
            "a routes file has `routes:`/`upstreams:`; a resources file has a `resources:` list of `identifier_glob` entries; a scenario has `tree:` and `clients_per_leaf:`".into(),
        );
        e
    })?;
    match kind {
        Kind::Routes => RoutesConfig::parse(&name, &text).map(|_| kind),
        Kind::Resources => ResourcesConfig::parse(&name, &text).map(|_| kind),
        Kind::Scenario => Scenario::parse(&name, &text).map(|_| kind),
    }
}

/// Runs `usher check`: 0 when every file is valid, 64 otherwise.
pub fn run(args: CheckArgs) -> Result<(), RunError> {
    let mut bad = 0;
    for f in &args.files {
        match check_file(f) {
            Ok(kind) => {
                println!("{}: ok ({})", f.display(), kind.name());
                if kind == Kind::Routes
                    && let Ok(cfg) = RoutesConfig::load(f)
                {
                    println!("  listener limits: {}", cfg.limits);
                    for (name, a) in cfg.upstreams.iter().filter_map(|(n, u)| Some((n, u.listen?))) {
                        println!("  upstream listener: {a} (every request on it goes to upstream `{name}`)");
                    }
                }
            }
            Err(e) => {
                bad += 1;
                eprintln!("{e}");
            }
        }
    }
    if bad > 0 {
        return Err(RunError::Usage(format!("{bad} of {} file(s) invalid", args.files.len())));
    }
    Ok(())
}

//! Which API a route leads to, when usher can tell: its own answers on such
//! a route (a 429, a 502) take that API's error shape, so the API's SDK in
//! the app reads them as it reads the API's own, and its exception carries
//! usher's message. [`RoutesConfig::api_dialect`] is the one place that
//! decides it.

use super::{RouteConfig, RoutesConfig};

/// The error shape of an API usher knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiDialect {
    /// OpenAI's: `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic's: `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

impl RoutesConfig {
    /// The API `route` leads to, judged from what its resources read of the
    /// answers: an `upstream_quota` preset of OpenAI's (`openai-*`) or
    /// Anthropic's (`anthropic-*`) headers. The first resource that names
    /// one decides; `None` (problem+json) for any other route.
    pub fn api_dialect(&self, route: &RouteConfig) -> Option<ApiDialect> {
        route.resources.iter().find_map(|(name, _)| {
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

//! Checks of a routes file as a whole, made once its parts are read: a setup
//! that can never forward is an error, a setting that is silently ignored a
//! warning. Each names the field's `file:line:column` and what to change.

use std::collections::BTreeMap;

use super::{Checker, Loc, MapView, Node, ResourceConfig, RouteConfig, UpstreamConfig, Value, field_loc};

/// Refuses an upstream `listen` that no route serves. Requests on an
/// upstream's own listener go only to routes with `upstream: NAME`; with none,
/// every request there gets a 403. (A route without `upstream` forwards to
/// the origin a request names, on the main listener: forward-proxy style,
/// which stays valid.)
pub(super) fn listeners_served(
    ck: &mut Checker,
    top: &MapView<'_>,
    upstreams: &BTreeMap<String, UpstreamConfig>,
    routes: &[RouteConfig],
) {
    let Some(section) = top.get("upstreams") else { return };
    for u in upstreams.values().filter(|u| u.listen.is_some()) {
        if routes.iter().any(|r| r.upstream.as_deref() == Some(u.name.as_str())) {
            continue;
        }
        let name = &u.name;
        let at = entry(section, name).and_then(|v| field_loc(v, "listen")).unwrap_or(section.loc);
        let without: Vec<String> = routes
            .iter()
            .filter(|r| r.upstream.is_none())
            .map(|r| match route_loc(top, &r.name) {
                Some(l) => format!("`{}` (line {})", r.name, l.line),
                None => format!("`{}`", r.name),
            })
            .collect();
        let hint = match without.as_slice() {
            [] => format!("add a route with `upstream: {name}`, or drop this `listen`"),
            [one] => format!(
                "add `upstream: {name}` to route {one}: a route without `upstream` serves only the main listener"
            ),
            many => format!(
                "add `upstream: {name}` to the routes meant for it ({} have none): a route without `upstream` \
                 serves only the main listener",
                many.join(", ")
            ),
        };
        ck.error(
            at,
            &format!("upstreams.{name}.listen"),
            format!("no route has `upstream: {name}`, so every request on this listener would get 403 (no-route)"),
            Some(hint),
        );
    }
}

/// Warns of `window: calendar` on a resource of a file with a `doorman:`
/// section: the capacity servers' resources file decides the window then,
/// and the routes file's is ignored.
pub(super) fn calendar_with_doorman(ck: &mut Checker, top: &MapView<'_>, resources: &BTreeMap<String, ResourceConfig>) {
    let Some(section) = top.get("resources") else { return };
    for r in resources.values().filter(|r| r.calendar) {
        let at = entry(section, &r.name).and_then(|v| field_loc(v, "window")).unwrap_or(section.loc);
        ck.warn(
            at,
            &format!("resources.{}.window", r.name),
            "`window: calendar` applies only without a `doorman:` section; with capacity servers it is ignored here",
            Some(format!(
                "write `window: calendar` in the capacity server's resources file, on the entry whose \
                 identifier_glob matches `{}` (docs/server.md, \"Calendar windows\")",
                r.id.text
            )),
        );
    }
}

/// The value of key `key` of mapping `node`.
fn entry<'a>(node: &'a Node, key: &str) -> Option<&'a Node> {
    match &node.value {
        Value::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
        _ => None,
    }
}

/// Where the route named `name` starts.
fn route_loc(top: &MapView<'_>, name: &str) -> Option<Loc> {
    let Value::Seq(items) = &top.get("routes")?.value else { return None };
    items.iter().find(|i| entry(i, "name").and_then(Node::as_str) == Some(name)).map(|i| i.loc)
}

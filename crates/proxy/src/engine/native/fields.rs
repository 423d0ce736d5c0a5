//! Field helpers both sides of the native path share: names compared
//! without case, comma-separated lists, `Content-Length` values, and
//! writing a field.

/// Case-insensitive field-name equality against a lower-case name.
pub(super) fn eq_name(name: &str, lower: &str) -> bool {
    name.len() == lower.len() && name.as_bytes().eq_ignore_ascii_case(lower.as_bytes())
}

/// The non-empty, trimmed elements of a comma-separated field value.
pub(super) fn tokens(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&b| b == b',').map(<[u8]>::trim_ascii).filter(|t| !t.is_empty())
}

/// Whether the comma-separated `list` has `token` (case-insensitive).
pub(super) fn list_has(list: &[u8], token: &[u8]) -> bool {
    tokens(list).any(|t| t.eq_ignore_ascii_case(token))
}

/// A Content-Length value: 1 to 19 ASCII digits.
pub(super) fn parse_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// Appends `name: value` and its line end.
pub(super) fn push_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

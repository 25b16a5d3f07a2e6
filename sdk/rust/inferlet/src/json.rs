//! The little JSON inferlets need, without a JSON crate: building documents
//! (`json_string`, `json_array`) and reading values out of tool responses (`json_value`).
//!
//! `json_value` finds the first `"key": value` anywhere in a document (no nesting
//! awareness) and returns a string value unescaped, any other value as its raw text.

/// `text` as a JSON string literal, quotes included.
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The value of the first `"key": value` in `json`: a string unescaped, anything else
/// (number, true/false/null, object, array) as its raw text. `None` if the key is absent.
pub fn json_value(json: &str, key: &str) -> Option<String> {
    find_value(json, key).map(|(value, _)| value)
}

/// Every value of `"key": value` in `json`, in order (see `json_value`).
pub fn json_values(json: &str, key: &str) -> Vec<String> {
    let (mut values, mut from) = (Vec::new(), 0);
    while let Some((value, end)) = find_value(&json[from..], key) {
        values.push(value);
        from += end;
    }
    values
}

/// The first value of `key` and the offset just past its key.
fn find_value(json: &str, key: &str) -> Option<(String, usize)> {
    let pattern = json_string(key);
    let mut from = 0;
    while let Some(found) = json[from..].find(&pattern) {
        from += found + pattern.len();
        if let Some(value) = json[from..].trim_start().strip_prefix(':') {
            let value = value.trim_start();
            return Some((match value.strip_prefix('"') {
                Some(string) => unescape(string),
                None => raw_value(value).to_string(),
            }, from));
        }
    }
    None
}

/// Unescapes a JSON string body (the text after its opening quote) up to its closing quote.
fn unescape(body: &str) -> String {
    let mut out = String::new();
    let mut chars = body.char_indices();
    while let Some((_, c)) = chars.next() {
        match c {
            '"' => return out,
            '\\' => match chars.next().map(|(_, e)| e) {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('r') => out.push('\r'),
                Some('b') => out.push('\u{8}'),
                Some('f') => out.push('\u{c}'),
                Some('u') => {
                    let hex: String = (0..4).filter_map(|_| chars.next().map(|(_, h)| h)).collect();
                    out.push(u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32).unwrap_or('\u{fffd}'));
                }
                Some(other) => out.push(other),
                None => break,
            },
            c => out.push(c),
        }
    }
    out
}

/// The raw text of a non-string value: up to the `,` `}` or `]` that ends it at depth 0.
fn raw_value(text: &str) -> &str {
    let (mut depth, mut in_string, mut escaped) = (0i32, false, false);
    for (i, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' if depth == 0 => return text[..i].trim_end(),
            '}' | ']' => depth -= 1,
            ',' if depth == 0 => return text[..i].trim_end(),
            _ => {}
        }
    }
    text.trim_end()
}

/// A JSON array of `items`, each already JSON.
pub fn json_array<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    let items: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
    format!("[{}]", items.join(", "))
}

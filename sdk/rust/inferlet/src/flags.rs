//! Launch arguments as `--name value` flags: parsed once, then read with defaults, with
//! errors that quote the inferlet's usage line.

use std::collections::HashMap;

/// Launch arguments as `--name value` pairs, plus `switches` given without a value
/// (present = "true"); anything else is an error quoting `usage`.
pub fn parse_args(args: &[String], names: &[&str], switches: &[&str], usage: &str)
                  -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let name = flag.strip_prefix("--").unwrap_or("");
        if switches.contains(&name) {
            out.insert(name.to_string(), "true".to_string());
        } else if names.contains(&name) {
            let value = rest.next().ok_or(format!("{flag} needs a value; usage: {usage}"))?;
            out.insert(name.to_string(), value.clone());
        } else {
            return Err(format!("unknown argument {flag:?}; usage: {usage}"));
        }
    }
    Ok(out)
}

/// The argument `name` parsed as a `T`, or `default` when absent.
pub fn arg_or<T: std::str::FromStr>(args: &HashMap<String, String>, name: &str,
                                    default: T, usage: &str) -> Result<T, String> {
    match args.get(name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| format!("invalid value for --{name}: {v:?}; usage: {usage}")),
    }
}

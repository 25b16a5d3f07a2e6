//! HTTP from an inferlet (to hosts on the server's allowlist).
//!
//! ```ignore
//! let body = format!("{{\"expression\": {}}}", json::json_string("17 * 23"));
//! let response = http::post_json("http://127.0.0.1:8090/tools/calculator", &body).await?;
//! let result = json::json_value(&response.body, "result"); // Some("391")
//! ```
//!
//! A request starts when `get` / `post_json` is called, not when its future is first
//! polled: a caller can start one, keep decoding, and await the response later (or hand it
//! to `spawn`). The futures borrow nothing, so they are `'static`.

use std::future::Future;

pub use crate::bindings::http::Response;
use crate::bindings::http::{http_get, http_post};
use crate::bindings::types::Error;

/// Starts a GET request to `url` (its host must be on the server's allowlist).
pub fn get(url: &str) -> impl Future<Output = Result<Response, Error>> + 'static {
    let started = http_get(url, &[]);
    async move { started?.await }
}

/// Starts a POST of the JSON document `body` to `url` (content-type application/json).
pub fn post_json(url: &str, body: &str) -> impl Future<Output = Result<Response, Error>> + 'static {
    let headers = [("content-type".to_string(), "application/json".to_string())];
    let started = http_post(url, &headers, body);
    async move { started?.await }
}

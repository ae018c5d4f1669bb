//! One error type for every failure the API returns, in OpenAI's shape
//! (`{"error":{"message","type","param","code"}}`), and the JSON extractor that turns bad
//! bodies into it with the offending field named.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 for a bad value of `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            code: Some("invalid_value"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 without a single field to blame.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model `{model}` does not exist or you do not have access to it."),
            )
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError {
            code: Some("not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("Unknown request URL: {path}"),
            )
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            code: Some("request_too_large"),
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("The request body is larger than the limit of {limit} bytes."),
            )
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "Missing or incorrect API key. Send it as `Authorization: Bearer KEY`.",
            )
        }
    }

    pub fn queue_full(waiting: usize) -> ApiError {
        ApiError {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "The server is busy: {waiting} sequences are already waiting. Retry later."
                ),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("service_unavailable"),
            retry_after: Some(5),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    /// 500; the detail is logged, the client gets a generic message.
    pub fn internal(detail: impl std::fmt::Display) -> ApiError {
        tracing::error!(error = %detail, "internal error");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "The server had an error while processing your request.",
        )
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// A JSON body whose every rejection is an [`ApiError`]: 413 over the body limit, 400 for
/// malformed JSON or a wrong type (naming the field).
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req.extensions().get::<BodyLimit>().map_or(0, |l| l.0);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(limit)
            } else {
                ApiError::bad_request(format!(
                    "Could not read the request body: {}",
                    e.body_text()
                ))
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// The configured body limit, put in request extensions so the 413 message can name it.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

/// Parses a JSON body; errors name the field path (`messages[0].role`).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::bad_request(format!("The request body is not valid JSON: {inner}"))
        } else if path == "." || path.is_empty() {
            ApiError::bad_request(format!("Invalid request body: {inner}"))
        } else {
            ApiError::invalid(&path, format!("Invalid value for `{path}`: {inner}"))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct T {
        temperature: Option<f32>,
        messages: Vec<M>,
    }
    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct M {
        role: String,
    }

    #[test]
    fn json_errors_name_the_field() {
        let e = parse_json::<T>(br#"{"temperature":"hot","messages":[]}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("temperature"), "{}", e.message);
        let e = parse_json::<T>(br#"{"messages":[{"role":5}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse_json::<T>(br#"{"messages":["#).unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        assert_eq!(e.param, None);
        let e = parse_json::<T>(br#"{}"#).unwrap_err();
        assert!(e.message.contains("messages"), "{}", e.message);
        let body = ApiError::queue_full(3).body();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert!(body["error"]["param"].is_null());
    }
}

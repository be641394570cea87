//! The routes' contract published on the serving listener: `GET` (or
//! `HEAD`) at `contract_path` answers the OpenAPI document `idem openapi`
//! prints, unauthenticated, made once at start.

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use idem_http::{ResponseBody, Routes};

/// The document and where it is published.
#[derive(Debug, Clone)]
pub(super) struct Published {
    path: String,
    document: Bytes,
}

impl Published {
    /// The document of `routes` at `path`, or `None` when no path is set.
    pub(super) fn new(path: Option<&str>, routes: &Routes) -> Option<Self> {
        let path = path?.to_owned();
        let document = serde_json::to_vec_pretty(&idem_http::openapi::document(routes))
            .expect("a JSON value serialises");
        Some(Self {
            path,
            document: Bytes::from(document),
        })
    }

    /// The answer to `req` when it asks for the document: nothing is
    /// forwarded nor recorded. Other methods on the path get `405`.
    pub(super) fn answer<B, R>(&self, req: &Request<B>) -> Option<Response<ResponseBody<R>>> {
        if req.uri().path() != self.path {
            return None;
        }
        let mut resp = Response::new(ResponseBody::full(if req.method() == Method::HEAD {
            Bytes::new()
        } else {
            self.document.clone()
        }));
        if req.method() == Method::GET || req.method() == Method::HEAD {
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/openapi+json"),
            );
        } else {
            *resp.body_mut() = ResponseBody::full(Bytes::new());
            *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        }
        Some(resp)
    }
}

//! The error classes every ternfleet process maps its errors to (../shared/CONVENTIONS.md
//! "Errors"), so that "overloaded" is 429 / `RESOURCE_EXHAUSTED` on every API and the
//! coordinator's failover decides from the class alone whether a retry elsewhere can help.

/// One class per way a call can fail, with its HTTP status and gRPC code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The request is malformed or breaks a limit (400 / `INVALID_ARGUMENT`).
    BadRequest,
    /// The named resource does not exist (404 / `NOT_FOUND`).
    NotFound,
    /// Missing or wrong credentials (401 / `UNAUTHENTICATED`).
    Unauthenticated,
    /// Queue full, too many concurrent streams (429 / `RESOURCE_EXHAUSTED`).
    Overloaded,
    /// Not ready, no live replica (503 / `UNAVAILABLE`): a retry, elsewhere or later, can help.
    Unavailable,
    /// A deadline passed (504 / `DEADLINE_EXCEEDED`).
    Timeout,
    /// The caller went away (499 / `CANCELLED`).
    Cancelled,
    /// A bug or an impossible state (500 / `INTERNAL`).
    Internal,
}

impl ErrorClass {
    /// The HTTP status code.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorClass::BadRequest => 400,
            ErrorClass::NotFound => 404,
            ErrorClass::Unauthenticated => 401,
            ErrorClass::Overloaded => 429,
            ErrorClass::Unavailable => 503,
            ErrorClass::Timeout => 504,
            ErrorClass::Cancelled => 499,
            ErrorClass::Internal => 500,
        }
    }

    /// The gRPC status code name.
    pub fn grpc_code(self) -> &'static str {
        match self {
            ErrorClass::BadRequest => "INVALID_ARGUMENT",
            ErrorClass::NotFound => "NOT_FOUND",
            ErrorClass::Unauthenticated => "UNAUTHENTICATED",
            ErrorClass::Overloaded => "RESOURCE_EXHAUSTED",
            ErrorClass::Unavailable => "UNAVAILABLE",
            ErrorClass::Timeout => "DEADLINE_EXCEEDED",
            ErrorClass::Cancelled => "CANCELLED",
            ErrorClass::Internal => "INTERNAL",
        }
    }

    /// Whether the same call may succeed if repeated (on another replica or a bit later).
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorClass::Unavailable | ErrorClass::Timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorClass::*;

    #[test]
    fn classes_map_to_the_conventions_codes() {
        let table = [
            (BadRequest, 400, "INVALID_ARGUMENT"),
            (NotFound, 404, "NOT_FOUND"),
            (Unauthenticated, 401, "UNAUTHENTICATED"),
            (Overloaded, 429, "RESOURCE_EXHAUSTED"),
            (Unavailable, 503, "UNAVAILABLE"),
            (Timeout, 504, "DEADLINE_EXCEEDED"),
            (Cancelled, 499, "CANCELLED"),
            (Internal, 500, "INTERNAL"),
        ];
        for (c, http, grpc) in table {
            assert_eq!((c.http_status(), c.grpc_code()), (http, grpc), "{c:?}");
        }
        assert!(Unavailable.is_retryable() && Timeout.is_retryable());
        assert!(!BadRequest.is_retryable() && !Internal.is_retryable());
    }
}

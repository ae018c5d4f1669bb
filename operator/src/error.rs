//! The operator's one error type.

/// Everything a reconcile can fail with. A bad spec is not an error: it is reported as a
/// condition and the reconcile succeeds, so only the API and the cluster land here.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("kubernetes api: {0}")]
    Kube(#[from] kube::Error),
    /// The finalizer machinery failed (it wraps our own errors too).
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// An object arrived without a field the API always sets.
    #[error("object is missing {0}")]
    MissingField(&'static str),
    /// Serializing an object failed.
    #[error("serialize: {0}")]
    Serialize(#[from] serde_json::Error),
}

/// `Result` with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Every value [`Error::metric_label`] returns.
    pub const METRIC_LABELS: [&'static str; 4] =
        ["kube", "finalizer", "missing_field", "serialize"];

    /// A bounded label for the errors metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.metric_label(),
                _ => "finalizer",
            },
            Error::MissingField(_) => "missing_field",
            Error::Serialize(_) => "serialize",
        }
    }
}

//! Opening a connection to the upstream: TCP, then TLS for `https://`
//! (SNI and the certificate's name from the URL's host, the protocol
//! chosen by ALPN), and telling a TLS refusal from other failures.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Authority;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::ServerName;
use rustls::sign::CertifiedKey;
use rustls::{AlertDescription, ClientConfig, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// How long a new connection may take to open, TLS handshake included.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to the upstream, plain or TLS.
#[derive(Debug)]
pub(super) enum Stream {
    /// `http://`.
    Plain(TcpStream),
    /// `https://` (boxed: a TLS session is some 1 KB beside a socket's few
    /// bytes), noting a refusal of the session when it reads one.
    Tls(Box<TlsStream<TcpStream>>, Refusal),
}

/// Why no connection could be opened. Either way nothing was sent.
#[derive(Debug)]
pub(super) enum ConnectError {
    /// No TCP connection (refused, unreachable, or too slow).
    Unreachable(String),
    /// No trusted TLS session: the upstream's certificate failed
    /// verification, or the upstream refused the handshake.
    Tls(String),
}

/// Opens connections to one upstream origin.
#[derive(Debug)]
pub(super) struct Connector {
    addr: String,
    tls: Option<Tls>,
}

/// The TLS side of a [`Connector`].
struct Tls {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    /// A client certificate is configured (`upstream_client_cert`).
    identity: bool,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("name", &self.name)
            .field("identity", &self.identity)
            .finish()
    }
}

impl Connector {
    /// Connections to `authority`: over TLS with `tls`, plain without.
    pub(super) fn new(authority: &Authority, tls: Option<Arc<ClientConfig>>) -> Self {
        let host = authority.host();
        let default_port = if tls.is_some() { 443 } else { 80 };
        let tls = tls.map(|config| {
            // An IPv6 literal comes bracketed in a URL, bare in a name.
            let bare = host.trim_start_matches('[').trim_end_matches(']');
            let name = ServerName::try_from(bare.to_owned())
                .expect("the config checked that an https:// upstream's host is a TLS name");
            Tls {
                identity: config.client_auth_cert_resolver.has_certs(),
                config,
                name,
            }
        });
        Self {
            addr: format!("{host}:{}", authority.port_u16().unwrap_or(default_port)),
            tls,
        }
    }

    /// A new connection, and whether the upstream chose HTTP/2 by ALPN.
    pub(super) async fn connect(&self) -> Result<(Stream, bool), ConnectError> {
        match tokio::time::timeout(CONNECT_TIMEOUT, self.open()).await {
            Ok(opened) => opened,
            Err(_) => Err(ConnectError::Unreachable(format!(
                "no connection to {} within {CONNECT_TIMEOUT:?}",
                self.addr
            ))),
        }
    }

    async fn open(&self) -> Result<(Stream, bool), ConnectError> {
        let addr = &self.addr;
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|err| ConnectError::Unreachable(format!("cannot connect to {addr}: {err}")))?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok((Stream::Plain(tcp), false));
        };
        // Without a certificate of its own, the gateway watches whether
        // the upstream asks for one (a fresh copy of the config per
        // connection, so the answer is this connection's).
        let (config, asked) = if tls.identity {
            (Arc::clone(&tls.config), None)
        } else {
            let asked = Arc::new(AtomicBool::new(false));
            let mut config = ClientConfig::clone(&tls.config);
            config.client_auth_cert_resolver = Arc::new(AskedFor {
                inner: Arc::clone(&config.client_auth_cert_resolver),
                asked: Arc::clone(&asked),
            });
            (Arc::new(config), Some(asked))
        };
        let handshake = TlsConnector::from(config)
            .connect(tls.name.clone(), tcp)
            .await;
        // Asked for a certificate the gateway does not have: a server
        // that requires one refuses the session once the gateway's side of
        // the handshake is done (TLS 1.3), often with a reset that loses
        // its alert, so a request written meanwhile could not be told from
        // one whose answer was lost. Nothing is sent on such a connection.
        if asked.is_some_and(|a| a.load(Ordering::Relaxed)) {
            return Err(ConnectError::Tls(format!(
                "TLS with {addr}: the upstream asks for a client certificate and the gateway has none (set upstream_client_cert and upstream_client_key)"
            )));
        }
        match handshake {
            Ok(tls) => {
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                Ok((Stream::Tls(Box::new(tls), Refusal::default()), h2))
            }
            Err(err) => Err(match rustls_error(&err) {
                Some(tls) => ConnectError::Tls(format!("TLS with {addr} failed: {tls}")),
                // The line dropped during the handshake: unreachable, as
                // a refused connection is.
                None => ConnectError::Unreachable(format!(
                    "the TLS handshake with {addr} broke off: {err}"
                )),
            }),
        }
    }
}

/// A client-certificate resolver that notes that the server asked for a
/// certificate (rustls asks its resolver only then).
#[derive(Debug)]
struct AskedFor {
    inner: Arc<dyn ResolvesClientCert>,
    asked: Arc<AtomicBool>,
}

impl ResolvesClientCert for AskedFor {
    fn resolve(
        &self,
        root_hint_subjects: &[&[u8]],
        sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.asked.store(true, Ordering::Relaxed);
        self.inner.resolve(root_hint_subjects, sigschemes)
    }

    fn has_certs(&self) -> bool {
        self.inner.has_certs()
    }
}

/// The TLS alerts by which a server refuses a handshake (the gateway's
/// certificate, or the session it offered). Under TLS 1.3 a server judges
/// the client's certificate after the client has finished its side of the
/// handshake, so the alert can arrive after the first request was written:
/// a server that sent it never took the request in.
const HANDSHAKE_REFUSALS: &[AlertDescription] = &[
    AlertDescription::CertificateRequired,
    AlertDescription::BadCertificate,
    AlertDescription::UnsupportedCertificate,
    AlertDescription::CertificateRevoked,
    AlertDescription::CertificateExpired,
    AlertDescription::CertificateUnknown,
    AlertDescription::UnknownCA,
    AlertDescription::AccessDenied,
    AlertDescription::HandshakeFailure,
    AlertDescription::ProtocolVersion,
    AlertDescription::InsufficientSecurity,
    AlertDescription::NoApplicationProtocol,
];

/// Whether the upstream refused the TLS session on a connection, after the
/// gateway's side of the handshake (see [`HANDSHAKE_REFUSALS`]): the
/// gateway's certificate, say. The stream notes it when the alert is
/// read, whichever way hyper then reports the failed request ("canceled",
/// "connection error"), so the proxy can tell a refusal from an answer
/// lost after sending. (A server that resets the connection right after
/// its alert may have it discarded unread: then the request's failure is
/// judged as any other.)
#[derive(Debug, Clone, Default)]
pub(super) struct Refusal(Arc<OnceLock<String>>);

impl Refusal {
    /// The refusal, if the upstream sent one.
    pub(super) fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }

    /// Notes `result`'s error if it is a handshake refusal.
    fn note<T>(&self, result: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if let Poll::Ready(Err(err)) = &result
            && let Some(rustls::Error::AlertReceived(alert)) = rustls_error(err)
            && HANDSHAKE_REFUSALS.contains(alert)
        {
            let _ = self
                .0
                .set(format!("the upstream refused the TLS session: {alert:?}"));
        }
        result
    }
}

/// The rustls error inside an I/O error of a TLS stream.
fn rustls_error(err: &io::Error) -> Option<&rustls::Error> {
    err.get_ref()?.downcast_ref::<rustls::Error>()
}

impl Stream {
    /// Where a refusal of the TLS session is noted (a plain connection
    /// never has one).
    pub(super) fn refusal(&self) -> Refusal {
        match self {
            Self::Plain(_) => Refusal::default(),
            Self::Tls(_, refusal) => refusal.clone(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s, r) => r.note(Pin::new(s.as_mut()).poll_read(cx, buf)),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s, r) => r.note(Pin::new(s.as_mut()).poll_write(cx, buf)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s, r) => r.note(Pin::new(s.as_mut()).poll_write_vectored(cx, bufs)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s, _) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s, r) => r.note(Pin::new(s.as_mut()).poll_flush(cx)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s, r) => r.note(Pin::new(s.as_mut()).poll_shutdown(cx)),
        }
    }
}

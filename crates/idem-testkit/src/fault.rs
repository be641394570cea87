//! A TCP fault proxy: put it between a client and a real server (the
//! gateway and PostgreSQL, say) and cut the line on demand, as if the
//! server had gone away, then restore it — without stopping a server other
//! tests share.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

#[derive(Debug, Default)]
struct State {
    cut: AtomicBool,
    links: Mutex<Vec<AbortHandle>>,
}

/// A running fault proxy; it stops with the test's runtime.
#[derive(Debug, Clone)]
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
}

impl FaultProxy {
    /// Starts on `127.0.0.1:0`, forwarding every connection to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(State::default());
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                if shared.cut.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let link = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                let mut links = shared.links.lock().unwrap_or_else(|p| p.into_inner());
                links.retain(|l| !l.is_finished());
                links.push(link.abort_handle());
            }
        });
        Self { addr, state }
    }

    /// Where clients connect instead of the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        for link in self
            .state
            .links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            link.abort();
        }
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }
}

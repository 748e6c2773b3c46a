//! The HTTP server's connections, bounded so that one client cannot hold the node's sockets
//! or memory: at most [`ConnectionLimits::total`] open at once and
//! [`ConnectionLimits::per_client`] from one address (a connection over either is answered
//! 503 or 429 and closed at once), and a request's headers must arrive within
//! [`ConnectionLimits::header_timeout`] (a client sending a byte a second is cut off). Each
//! request carries its client's address (`ConnectInfo`), as the routes expect.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tower::ServiceExt;

/// How many connections a node keeps, and how long a request's headers may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once, from all clients.
    pub total: usize,
    /// Connections open at once from one address.
    pub per_client: usize,
    /// How long a request's headers may take to arrive.
    pub header_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            total: 512,
            per_client: 64,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// The open connections, in all and by address.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
}

/// One connection's place among the open ones, given back when it closes.
struct Held {
    open: Arc<Mutex<Open>>,
    ip: IpAddr,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut g = self.open.lock().unwrap_or_else(|e| e.into_inner());
        g.total -= 1;
        if let Some(n) = g.by_client.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                g.by_client.remove(&self.ip);
            }
        }
    }
}

/// A place for a connection from `ip`, or the status and reason it is refused with.
fn admit(
    open: &Arc<Mutex<Open>>,
    ip: IpAddr,
    limits: &ConnectionLimits,
) -> Result<Held, (u16, &'static str)> {
    let mut g = open.lock().unwrap_or_else(|e| e.into_inner());
    if g.total >= limits.total {
        return Err((
            503,
            "this node has as many connections open as it takes; retry shortly",
        ));
    }
    let mine = g.by_client.entry(ip).or_insert(0);
    if *mine >= limits.per_client {
        return Err((429, "this address has as many connections open as one client may; close some or retry shortly"));
    }
    *mine += 1;
    g.total += 1;
    Ok(Held {
        open: open.clone(),
        ip,
    })
}

/// Answers a refused connection with `status` and closes it.
async fn refuse(mut stream: tokio::net::TcpStream, status: u16, why: &str) {
    let body = serde_json::json!({"error": {"message": why, "type": "server_error", "code": "too_many_connections"}})
        .to_string();
    let reason = if status == 429 {
        "Too Many Requests"
    } else {
        "Service Unavailable"
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then lets the
/// open connections finish.
///
/// # Errors
/// Never for one connection's failure; accepting is retried after a failure (too many open
/// files, say).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    limits: ConnectionLimits,
) -> std::io::Result<()> {
    let open = Arc::new(Mutex::new(Open::default()));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let held = match admit(&open, peer.ip(), &limits) {
            Ok(h) => h,
            Err((status, why)) => {
                tracing::warn!(%peer, status, "refused a connection: {why}");
                tokio::spawn(refuse(stream, status, why));
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = router.clone().map_request(
            move |mut req: axum::extract::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                req
            },
        );
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout);
        let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _held = held;
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "a connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_counted_in_all_and_per_address() {
        let open = Arc::new(Mutex::new(Open::default()));
        let limits = ConnectionLimits {
            total: 3,
            per_client: 2,
            header_timeout: Duration::from_secs(1),
        };
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = admit(&open, a, &limits).unwrap();
        let _a2 = admit(&open, a, &limits).unwrap();
        assert_eq!(admit(&open, a, &limits).err().map(|e| e.0), Some(429));
        let _b1 = admit(&open, b, &limits).unwrap();
        assert_eq!(admit(&open, b, &limits).err().map(|e| e.0), Some(503));
        drop(a1);
        assert!(
            admit(&open, b, &limits).is_ok(),
            "a closed connection gives its place back"
        );
    }
}

//! A Hugging Face-style model hub on loopback, for tests of `shoal models pull` that reach
//! nothing else: [`HubServer`] serves, over plain HTTP/1.1 on `127.0.0.1` (a port chosen by
//! the system), the hub's URL layout for the repositories it is given:
//!
//! - `GET /api/models/ORG/REPO/revision/REV` (any query): `{"id", "sha", "siblings":
//!   [{"rfilename", "size", "lfs": {"sha256", "size"}}]}`, 404 for an unknown repository or
//!   revision;
//! - `GET /ORG/REPO/resolve/REV/PATH`: a 302 redirect to `/cdn/ORG/REPO/COMMIT/PATH`, as the
//!   hub sends downloads elsewhere, or 404 for a file it does not serve;
//! - `GET /cdn/...`: the file's bytes, from the offset of a `Range: bytes=N-` header (206 with
//!   `Content-Range`, 416 past the end).
//!
//! A file may be listed with a wrong sha256 or listed but not served, and a one-shot
//! [`Fault`] cuts or stalls the next download of a file part way, or answers its range
//! from the wrong offset. Every request is recorded
//! (path and `Range`) for the test to check what the client asked.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::json;
use sha2::{Digest, Sha256};

/// A file of a served repository.
#[derive(Clone, Debug)]
pub struct HubFile {
    /// Its path in the repository.
    pub name: String,
    pub data: Vec<u8>,
    /// The sha256 the listing gives instead of the data's (to test verification).
    pub listed_sha256: Option<String>,
    /// Whether downloads of it are served (false: listed, but 404).
    pub served: bool,
}

impl HubFile {
    /// A file listed and served as it is.
    pub fn new(name: &str, data: Vec<u8>) -> HubFile {
        HubFile {
            name: name.to_string(),
            data,
            listed_sha256: None,
            served: true,
        }
    }
}

/// A served repository at one commit.
#[derive(Clone, Debug)]
pub struct HubRepo {
    /// `ORG/REPO`.
    pub repo: String,
    /// The commit its `main` points at (40 hex digits).
    pub commit: String,
    pub files: Vec<HubFile>,
}

/// Something the next download of a file suffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The connection closes after this many bytes of the body.
    CutAfter(usize),
    /// The body stops after this many bytes and the connection is held open until
    /// [`HubServer::release`].
    StallAfter(usize),
    /// A ranged download is answered 206 with the whole file (`Content-Range` from 0), as a
    /// broken proxy might.
    WrongRange,
}

/// A request the server received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub path: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
}

#[derive(Default)]
struct State {
    repos: Vec<HubRepo>,
    faults: Vec<(String, Fault)>,
    seen: Vec<Seen>,
    released: bool,
}

/// The hub; it stops serving when dropped.
pub struct HubServer {
    port: u16,
    state: Arc<(Mutex<State>, Condvar)>,
    stop: Arc<AtomicBool>,
}

impl HubServer {
    /// Starts serving `repos`.
    ///
    /// # Panics
    /// When no loopback port can be bound (a test set-up failure).
    pub fn start(repos: Vec<HubRepo>) -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
        let port = listener.local_addr().expect("bound address").port();
        let state = Arc::new((
            Mutex::new(State {
                repos,
                ..State::default()
            }),
            Condvar::new(),
        ));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                thread::spawn(move || serve(conn, &st));
            }
        });
        HubServer { port, state, stop }
    }

    /// The base URL, for `HF_ENDPOINT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Makes the next download of `file` (its path in the repository) suffer `fault`.
    pub fn fault(&self, file: &str, fault: Fault) {
        let mut s = self.state.0.lock().unwrap();
        s.released = false;
        s.faults.push((file.to_string(), fault));
    }

    /// Lets stalled downloads end (their connections close without the rest).
    pub fn release(&self) {
        self.state.0.lock().unwrap().released = true;
        self.state.1.notify_all();
    }

    /// The requests so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.0.lock().unwrap().seen.clone()
    }

    /// The downloads of `file` so far: the `Range` header of each (`None`: from the start).
    pub fn downloads(&self, file: &str) -> Vec<Option<String>> {
        self.seen()
            .into_iter()
            .filter(|s| s.path.starts_with("/cdn/") && s.path.ends_with(&format!("/{file}")))
            .map(|s| s.range)
            .collect()
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.release();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn respond(conn: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(body);
}

fn not_found(conn: &mut TcpStream, what: &str) {
    let body = json!({"error": what}).to_string();
    respond(
        conn,
        "404 Not Found",
        &[("Content-Type", "application/json".into())],
        body.as_bytes(),
    );
}

fn serve(mut conn: TcpStream, state: &(Mutex<State>, Condvar)) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(conn.try_clone().expect("cloning a socket"));
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
        }
    }
    let repos = {
        let mut s = state.0.lock().unwrap();
        s.seen.push(Seen {
            path: path.clone(),
            range: range.clone(),
        });
        s.repos.clone()
    };
    let path_only = path.split('?').next().unwrap_or("");
    let parts: Vec<&str> = path_only.trim_start_matches('/').split('/').collect();
    let find = |org: &str, name: &str| {
        repos
            .iter()
            .find(|r| r.repo == format!("{org}/{name}"))
            .cloned()
    };
    match parts[..] {
        ["api", "models", org, name, "revision", rev] => match find(org, name) {
            Some(r) if rev == "main" || rev == r.commit => {
                let siblings: Vec<_> = r
                    .files
                    .iter()
                    .map(|f| {
                        let sha = f
                            .listed_sha256
                            .clone()
                            .unwrap_or_else(|| format!("{:x}", Sha256::digest(&f.data)));
                        json!({
                            "rfilename": f.name,
                            "size": f.data.len(),
                            "lfs": {"sha256": sha, "size": f.data.len(), "pointerSize": 134},
                        })
                    })
                    .collect();
                let body = json!({"id": r.repo, "sha": r.commit, "siblings": siblings});
                respond(
                    &mut conn,
                    "200 OK",
                    &[("Content-Type", "application/json".into())],
                    body.to_string().as_bytes(),
                );
            }
            Some(_) => not_found(&mut conn, "Revision not found"),
            None => not_found(&mut conn, "Repository not found"),
        },
        [org, name, "resolve", _rev, ref file @ ..] if !file.is_empty() => {
            let file = file.join("/");
            match find(org, name) {
                Some(r) if r.files.iter().any(|f| f.name == file && f.served) => {
                    let to = format!("/cdn/{org}/{name}/{}/{file}", r.commit);
                    respond(&mut conn, "302 Found", &[("Location", to)], b"");
                }
                _ => not_found(&mut conn, "Entry not found"),
            }
        }
        ["cdn", org, name, _commit, ref file @ ..] if !file.is_empty() => {
            let file = file.join("/");
            let Some(f) =
                find(org, name).and_then(|r| r.files.into_iter().find(|f| f.name == file))
            else {
                return not_found(&mut conn, "Entry not found");
            };
            download(&mut conn, state, &f, range.as_deref());
        }
        _ => not_found(&mut conn, "no such route"),
    }
}

fn download(
    conn: &mut TcpStream,
    state: &(Mutex<State>, Condvar),
    f: &HubFile,
    range: Option<&str>,
) {
    let len = f.data.len();
    let from = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    let fault = {
        let mut s = state.0.lock().unwrap();
        let i = s.faults.iter().position(|(n, _)| *n == f.name);
        i.map(|i| s.faults.remove(i).1)
    };
    let (status, start, mut headers) = match from {
        Some(n) if n >= len => {
            respond(
                conn,
                "416 Range Not Satisfiable",
                &[("Content-Range", format!("bytes */{len}"))],
                b"",
            );
            return;
        }
        Some(_) if fault == Some(Fault::WrongRange) => (
            "206 Partial Content",
            0,
            vec![("Content-Range", format!("bytes 0-{}/{len}", len - 1))],
        ),
        Some(n) => (
            "206 Partial Content",
            n,
            vec![("Content-Range", format!("bytes {n}-{}/{len}", len - 1))],
        ),
        None => ("200 OK", 0, Vec::new()),
    };
    headers.push(("Content-Type", "application/octet-stream".into()));
    let body = &f.data[start..];
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in &headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    if conn.write_all(head.as_bytes()).is_err() {
        return;
    }
    match fault {
        None | Some(Fault::WrongRange) => {
            let _ = conn.write_all(body);
        }
        Some(Fault::CutAfter(n)) => {
            let _ = conn.write_all(&body[..n.min(body.len())]);
            let _ = conn.flush();
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        Some(Fault::StallAfter(n)) => {
            let _ = conn.write_all(&body[..n.min(body.len())]);
            let _ = conn.flush();
            let (m, cv) = state;
            let mut s = m.lock().unwrap();
            while !s.released {
                s = cv.wait(s).unwrap();
            }
            drop(s);
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
    }
}

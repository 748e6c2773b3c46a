//! The dashboard in a real headless browser (Chromium from Debian's packages, driven over
//! the DevTools protocol) against three loopback nodes, each offering at most 800 MB so that
//! qwen05 must be split: the page lists every node and link; placing qwen05 from the page
//! shows the planner's candidates, then the instance's progress and placement; a chat answer
//! streams into the page; killing a node of the instance greys it out and the re-placement
//! appears; no request leaves the node; and once the cluster has API keys the page asks for
//! one and shows nothing of the cluster without it.
//!
//! Without a Chromium binary the test says so and passes, unless `SHOAL_REQUIRE_BROWSER=1`
//! (CI sets it). `SHOAL_DASHBOARD_SHOTS=DIR` saves screenshots at 1280x800 and 390x844.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{cached_model, node, run, wait_until, Node};
use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

/// A headless Chromium, killed when dropped.
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Debian's command is a shell script that runs the browser as its child: end the
        // whole process group the browser was started in
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chromium() -> Option<String> {
    ["chromium-headless-shell", "chromium", "chromium-browser"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(str::to_string)
}

/// A page of a new browser, over the DevTools protocol.
struct Page {
    ws: WebSocket<TcpStream>,
    next: u64,
    /// Every URL the page requested.
    requests: Vec<String>,
}

impl Page {
    fn open(bin: &str) -> (Browser, Page) {
        let profile = tempfile::tempdir().unwrap();
        use std::os::unix::process::CommandExt;
        let mut child = Command::new(bin)
            .process_group(0)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                "--window-size=1280,800",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        let ws_url = loop {
            line.clear();
            assert!(err.read_line(&mut line).unwrap() > 0, "chromium ended");
            if let Some(u) = line.trim().strip_prefix("DevTools listening on ") {
                break u.to_string();
            }
        };
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = err.read_to_end(&mut sink);
        });
        let browser = Browser {
            child,
            _profile: profile,
        };
        // the page target of the browser
        let host = ws_url
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .unwrap()
            .to_string();
        let list: Value = wait_until(Duration::from_secs(10), "a page target", || {
            let v: Value = ureq::get(&format!("http://{host}/json/list"))
                .call()
                .ok()?
                .body_mut()
                .read_json()
                .ok()?;
            v.as_array()?
                .iter()
                .any(|t| t["type"] == "page")
                .then_some(v)
        });
        let page_ws = list
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .unwrap()["webSocketDebuggerUrl"]
            .as_str()
            .unwrap()
            .to_string();
        let stream = TcpStream::connect(&host).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (ws, _) = tungstenite::client(page_ws.as_str(), stream).unwrap();
        let mut page = Page {
            ws,
            next: 0,
            requests: Vec::new(),
        };
        page.call("Network.enable", json!({}));
        page.call("Page.enable", json!({}));
        (browser, page)
    }

    /// Calls `method`, noting the requests the page made meanwhile; returns the result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::Text(msg.into())).unwrap();
        loop {
            let m = self.ws.read().unwrap();
            let Message::Text(t) = m else { continue };
            let v: Value = serde_json::from_str(t.as_str()).unwrap();
            if v["method"] == "Network.requestWillBeSent" {
                if let Some(u) = v["params"]["request"]["url"].as_str() {
                    self.requests.push(u.to_string());
                }
            }
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// The value of a JavaScript expression (awaited when it is a promise).
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "awaitPromise": true, "returnByValue": true}),
        );
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {r}");
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is truthy (an expression that throws, e.g. while the page loads,
    /// is not yet).
    fn until(&mut self, limit: Duration, what: &str, expr: &str) -> Value {
        let t0 = Instant::now();
        let guarded =
            format!("(() => {{ try {{ return ({expr}); }} catch (e) {{ return false; }} }})()");
        loop {
            let v = self.eval(&guarded);
            if !(v.is_null() || v == false || v == 0 || v == "") {
                return v;
            }
            assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
    }

    /// Saves a screenshot at `width` x `height` to `SHOAL_DASHBOARD_SHOTS/name.png`.
    /// The page is scrolled to the element `at` first.
    fn shot(&mut self, name: &str, width: u32, height: u32, mobile: bool, at: &str) {
        let Some(dir) = std::env::var_os("SHOAL_DASHBOARD_SHOTS") else {
            return;
        };
        self.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}),
        );
        std::thread::sleep(Duration::from_millis(300));
        self.eval(&format!(
            "document.getElementById('{at}').scrollIntoView(); true"
        ));
        std::thread::sleep(Duration::from_millis(300));
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = base64_decode(r["data"].as_str().unwrap());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(std::path::Path::new(&dir).join(format!("{name}.png")), png).unwrap();
        self.call("Emulation.clearDeviceMetricsOverride", json!({}));
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let v: Vec<u32> = chunk.iter().map(|&c| val(c) as u32).collect();
        let n = v.iter().fold(0u32, |a, &x| a << 6 | x) << (6 * (4 - v.len()));
        for k in 0..v.len() - 1 {
            out.push((n >> (16 - 8 * k)) as u8);
        }
    }
    out
}

#[test]
fn the_dashboard_shows_places_chats_and_follows_a_node_death() {
    let Some(bin) = chromium() else {
        assert!(
            std::env::var("SHOAL_REQUIRE_BROWSER").as_deref() != Ok("1"),
            "no Chromium: apt-get install chromium-headless-shell"
        );
        eprintln!("skipped: no Chromium (apt-get install chromium-headless-shell)");
        return;
    };
    let Some(model) = cached_model("qwen05") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = common::secret(dir.path());
    let home = model.parent().unwrap().parent().unwrap().to_path_buf();
    let a = node(dir.path(), "alpha", &secret, &home, None, &[]);
    let seed = a.listen.clone();
    let mut nodes: Vec<Node> = vec![a];
    for n in ["beta", "gamma"] {
        nodes.push(node(dir.path(), n, &secret, &home, Some(&seed), &[]));
    }
    common::agree(&nodes);
    let url = nodes[0].url.clone();

    // the page's weight: one document, well under 300 KB
    let page_bytes = ureq::get(&url)
        .call()
        .unwrap()
        .body_mut()
        .read_to_vec()
        .unwrap()
        .len();
    assert!(page_bytes < 300 << 10, "{page_bytes} bytes");

    let (_browser, mut page) = Page::open(&bin);
    page.navigate(&url);
    // every node and every measured pair
    page.until(
        Duration::from_secs(30),
        "three node cards",
        "document.querySelectorAll('#nodes .card').length === 3",
    );
    for n in ["alpha", "beta", "gamma"] {
        let shown = page.eval(&format!(
            "!!document.querySelector('#nodes [data-node=\"{n}\"]') && document.getElementById('graph').textContent.includes('{n}')"
        ));
        assert_eq!(shown, true, "{n} on the page");
    }
    // the doctor's findings, as `shoal doctor` has them
    page.until(
        Duration::from_secs(15),
        "the doctor's findings",
        "['secret', 'strangers', 'mdns', 'reachable', 'clock'].every(c => document.querySelector(`#findings tr[data-check=\"${c}\"]`))",
    );
    page.until(
        Duration::from_secs(30),
        "the links of every pair",
        "new Set([...document.querySelectorAll('#links tbody tr')].map(r => [...r.cells].slice(0,2).map(c => c.textContent).sort().join('|'))).size === 3",
    );

    // place qwen05: the planner's candidates, then progress, then the placement
    page.until(
        Duration::from_secs(10),
        "qwen05 offered",
        "[...document.getElementById('p-model').options].some(o => o.value === 'qwen05')",
    );
    page.eval(
        "document.getElementById('p-model').value = 'qwen05'; document.getElementById('p-ctx').value = '512'; document.querySelector('#plan-form button').click(); true",
    );
    let candidates = page.until(
        Duration::from_secs(30),
        "the planner's candidates",
        "document.querySelectorAll('#candidates tbody tr').length",
    );
    eprintln!("{candidates} candidates");
    page.until(
        Duration::from_secs(5),
        "a candidate that fits",
        "!document.getElementById('load').disabled",
    );
    page.shot("nodes-1280x800", 1280, 800, false, "topology");
    page.shot("nodes-390x844", 390, 844, true, "topology");
    page.shot("place-1280x800", 1280, 800, false, "instances");
    page.eval("document.getElementById('load').click(); true");
    let mut seen = std::collections::BTreeSet::new();
    let t0 = Instant::now();
    loop {
        let state = page.eval(
            "(document.querySelector('[data-instance=\"qwen05\"] .badge') || {}).textContent || ''",
        );
        if let Some(s) = state.as_str().filter(|s| !s.is_empty()) {
            seen.insert(s.to_string());
            if s == "ready" {
                break;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(180), "ready: {seen:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("instance states seen on the page: {seen:?}");
    let rows = page.eval(
        "[...document.querySelectorAll('[data-instance=\"qwen05\"] .bar span')].map(s => s.textContent)",
    );
    eprintln!("placement rows: {rows}");
    assert!(
        rows.as_array().unwrap().len() >= 2,
        "split over nodes: {rows}"
    );

    // a chat answer streams in
    page.until(
        Duration::from_secs(10),
        "qwen05 to chat with",
        "[...document.getElementById('c-model').options].some(o => o.value === 'qwen05')",
    );
    page.eval(
        "document.getElementById('c-model').value = 'qwen05'; document.getElementById('c-input').value = 'Write two sentences about the sea.'; document.getElementById('c-send').click(); true",
    );
    let mut lengths = std::collections::BTreeSet::new();
    let t0 = Instant::now();
    loop {
        let v = page.eval(
            "[(document.querySelector('#log .assistant .body') || {}).textContent || '', (document.querySelector('#log .assistant .stats') || {}).textContent || '']",
        );
        let body = v[0].as_str().unwrap_or("");
        if !body.is_empty() {
            lengths.insert(body.len());
        }
        if v[1].as_str().unwrap_or("").contains("first token")
            && !page
                .eval("document.getElementById('c-send').disabled")
                .as_bool()
                .unwrap()
        {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "the answer: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("answer lengths seen while streaming: {lengths:?}");
    assert!(
        lengths.len() >= 2,
        "the answer grew on the page: {lengths:?}"
    );
    // JSON output is shown as JSON
    page.eval(
        "document.getElementById('c-json').checked = true; document.getElementById('c-input').value = 'Give a JSON object whose key city is Paris.'; document.getElementById('c-send').click(); true",
    );
    let shown = page.until(
        Duration::from_secs(120),
        "the JSON answer",
        "(() => { const m = document.querySelectorAll('#log .assistant'); const last = m[m.length - 1]; const pre = last && last.querySelector('pre.json'); return m.length === 2 && pre && !document.getElementById('c-send').disabled && (JSON.parse(pre.textContent), pre.textContent); })()",
    );
    eprintln!("JSON answer: {shown}");
    page.eval("document.getElementById('c-json').checked = false; true");
    page.shot("chat-1280x800", 1280, 800, false, "place");
    page.shot("chat-390x844", 390, 844, true, "chat");
    page.shot("figures-390x844", 390, 844, true, "instances");
    page.shot("doctor-390x844", 390, 844, true, "doctor");

    // kill a node of the instance other than the page's: greyed out, then re-placed
    let inst = page.eval("document.querySelector('[data-instance=\"qwen05\"] .dim').textContent");
    let on: Vec<String> = page
        .eval("[...document.querySelectorAll('[data-instance=\"qwen05\"] .bar span')].map(s => s.textContent.split(' ')[0])")
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let victim = on
        .iter()
        .find(|n| *n != "alpha")
        .expect("a node of the instance besides alpha")
        .clone();
    eprintln!("killing {victim} ({inst})");
    let i = nodes.iter().position(|n| n.name == victim).unwrap();
    nodes.remove(i);
    page.until(
        Duration::from_secs(15),
        "the dead node greyed out",
        &format!("!!document.querySelector('#nodes .card.dead[data-node=\"{victim}\"]')"),
    );
    page.until(
        Duration::from_secs(120),
        "the re-placement",
        &format!(
            "(() => {{ const c = document.querySelector('[data-instance=\"qwen05\"]'); return !!c && c.querySelector('.badge').textContent === 'ready' && c.textContent.includes('generation 2') && !c.querySelector('.bar').textContent.includes('{victim}'); }})()"
        ),
    );
    page.shot("dead-1280x800", 1280, 800, false, "topology");
    page.shot("replaced-1280x800", 1280, 800, false, "instances");

    // nothing was fetched from anywhere but this node
    let foreign: Vec<&String> = page
        .requests
        .iter()
        .filter(|u| !u.starts_with(&url) && !u.starts_with("about:") && !u.starts_with("data:"))
        .collect();
    assert!(foreign.is_empty(), "requests beyond the node: {foreign:?}");
    assert!(!page.requests.is_empty());

    // with API keys, the page asks for one and shows nothing of the cluster without it
    let (ok, out, err) = run(&["keys", "create", "--name", "ops", "--json", "--url", &url]);
    assert!(ok, "{err}");
    let key = serde_json::from_str::<Value>(&out).unwrap()["secret"]
        .as_str()
        .unwrap()
        .to_string();
    page.eval("localStorage.removeItem('shoal-key'); true");
    page.navigate(&url);
    page.until(
        Duration::from_secs(10),
        "the key prompt",
        "getComputedStyle(document.getElementById('auth')).display === 'flex'",
    );
    std::thread::sleep(Duration::from_millis(2500));
    let hidden = page.eval(
        "getComputedStyle(document.getElementById('main')).display === 'none' && document.querySelectorAll('#nodes .card').length === 0 && !document.body.innerText.includes('gamma')",
    );
    assert_eq!(hidden, true, "nothing of the cluster without a key");
    page.shot("key-390x844", 390, 844, true, "auth");
    page.eval(&format!(
        "document.getElementById('key').value = '{key}'; document.querySelector('#auth-form button').click(); true"
    ));
    page.until(
        Duration::from_secs(10),
        "the cluster with the key",
        "getComputedStyle(document.getElementById('main')).display !== 'none' && document.querySelectorAll('#nodes .card').length === 3",
    );
}

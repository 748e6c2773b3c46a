//! The HTTP client of the commands that talk to a running node (`keys`, and the cluster
//! commands to come): the node's URL from `--url` or `SHOAL_URL`, a key from `--key` or
//! `SHOAL_API_KEY`, and errors that carry the server's message.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::Value;

#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    /// The node's HTTP API.
    #[arg(
        long,
        env = "SHOAL_URL",
        default_value = "http://127.0.0.1:7337",
        global = true
    )]
    pub url: String,
    /// An API key (needed once the node has keys).
    #[arg(long, env = "SHOAL_API_KEY", global = true, hide_env_values = true)]
    pub key: Option<String>,
}

pub struct Client {
    agent: ureq::Agent,
    base: String,
    key: Option<String>,
}

impl Client {
    pub fn new(args: &ClientArgs) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(600)))
            .build()
            .into();
        Client {
            agent,
            base: args.url.trim_end_matches('/').to_string(),
            key: args.key.clone(),
        }
    }

    fn finish(
        &self,
        what: &str,
        resp: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> anyhow::Result<Value> {
        let mut resp = resp.with_context(|| {
            format!(
                "{what}: cannot reach {} (is `shoal serve` running there?)",
                self.base
            )
        })?;
        let status = resp.status();
        let text = resp
            .body_mut()
            .read_to_string()
            .with_context(|| format!("{what}: reading the answer"))?;
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        if !status.is_success() {
            let msg = v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .unwrap_or(&text);
            anyhow::bail!("{what}: the node answered {status}: {msg}");
        }
        Ok(v)
    }

    fn auth<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.key {
            Some(k) => req.header("Authorization", &format!("Bearer {k}")),
            None => req,
        }
    }

    pub fn get(&self, path: &str) -> anyhow::Result<Value> {
        let r = self
            .auth(self.agent.get(&format!("{}{path}", self.base)))
            .call();
        self.finish(&format!("GET {path}"), r)
    }

    pub fn post(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let r = self
            .auth(self.agent.post(&format!("{}{path}", self.base)))
            .send_json(body);
        self.finish(&format!("POST {path}"), r)
    }

    pub fn delete(&self, path: &str) -> anyhow::Result<Value> {
        let r = self
            .auth(self.agent.delete(&format!("{}{path}", self.base)))
            .call();
        self.finish(&format!("DELETE {path}"), r)
    }
}

/// Reads a server-sent-event stream, calling `on` with each `data:` JSON object until
/// `[DONE]`; an `error` object in the stream is an error.
pub fn for_each_event(
    body: impl std::io::Read,
    mut on: impl FnMut(&Value) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use std::io::BufRead;
    for line in std::io::BufReader::new(body).lines() {
        let line = line.context("reading the event stream")?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).context("an event that is not JSON")?;
        if let Some(e) = v.get("error") {
            anyhow::bail!(
                "the server failed the request: {}",
                e["message"].as_str().unwrap_or("unknown error")
            );
        }
        on(&v)?;
    }
    anyhow::bail!("the event stream ended without [DONE]")
}

impl Client {
    /// POSTs `body` to `path` and returns the streaming response.
    pub fn post_stream(&self, path: &str, body: &Value) -> anyhow::Result<ureq::Body> {
        let r = self
            .auth(self.agent.post(&format!("{}{path}", self.base)))
            .send_json(body);
        let mut resp = r.with_context(|| {
            format!(
                "POST {path}: cannot reach {} (is `shoal serve` running there?)",
                self.base
            )
        })?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
            let msg = v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .unwrap_or(&text);
            anyhow::bail!("POST {path}: the node answered {status}: {msg}");
        }
        Ok(resp.into_body())
    }
}

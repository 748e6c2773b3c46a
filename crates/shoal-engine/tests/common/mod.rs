//! Helpers the integration tests share.

/// The cached path of catalog model `key`; `None` (the test skips) when it is not fetched,
/// unless `SHOAL_REQUIRE_MODELS=1` (CI), which makes a missing model a failure.
pub fn model_path(key: &str) -> Option<std::path::PathBuf> {
    let found = shoal_model::catalog::Catalog::open_default()
        .ok()
        .and_then(|c| c.cached_path(key).ok().flatten());
    if found.is_none() {
        assert!(
            std::env::var("SHOAL_REQUIRE_MODELS").as_deref() != Ok("1"),
            "model `{key}` is not cached; run `shoal models fetch {key}`"
        );
        eprintln!("skipping: model `{key}` is not cached (shoal models fetch {key})");
    }
    found
}

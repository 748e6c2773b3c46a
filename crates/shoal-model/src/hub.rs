//! Naming a GGUF model in a Hugging Face-style repository: `hf:ORG/REPO[@REVISION][:QUANT]`
//! ([`HfRef`]), and picking the file or split set a quant tag names among a repository's
//! files ([`gguf_models`], [`pick`]). The same choice serves `shoal models pull`, which picks
//! among the files a hub lists, and resolving the name on disk, which picks among the files of
//! the cached snapshot, so a pulled model loads by the name it was pulled by. A quant tag
//! matches a file whose path, split at `-`, `.` and `/`, holds the tag's own pieces in a row
//! (ASCII case ignored): `Q4_K_M` matches `Model-Q4_K_M.gguf` and
//! `Q4_K_M/Model-Q4_K_M-00001-of-00002.gguf` but not `Model-Q4_K_S.gguf`. Projector files
//! (`mmproj*`) are not models.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::gguf::set::{parse_name, part_name};

/// The prefix of a hub model given as MODEL.
pub const HF_PREFIX: &str = "hf:";

/// A model in a Hugging Face-style repository, as `hf:ORG/REPO[@REVISION][:QUANT]` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfRef {
    /// `ORG/REPO`.
    pub repo: String,
    /// A branch, tag or commit (`main` unless given).
    pub revision: String,
    /// The quant tag naming one GGUF file or split set, if given.
    pub quant: Option<String>,
}

/// Why an `hf:` name could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{arg}` is not a hub model name ({problem}); expected hf:ORG/REPO[@REVISION][:QUANT], e.g. hf:org/Model-GGUF:Q4_K_M")]
pub struct BadRef {
    pub arg: String,
    pub problem: String,
}

fn plain(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('.')
        && s.len() <= 96
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl HfRef {
    /// Parses `hf:ORG/REPO[@REVISION][:QUANT]` (the prefix is required).
    ///
    /// # Errors
    /// When the prefix is missing or a part is empty or holds other characters than letters,
    /// digits, `-`, `_` and `.`.
    pub fn parse(arg: &str) -> Result<HfRef, BadRef> {
        let bad = |problem: &str| BadRef {
            arg: arg.to_string(),
            problem: problem.to_string(),
        };
        let rest = arg
            .strip_prefix(HF_PREFIX)
            .ok_or_else(|| bad("no hf: prefix"))?;
        let (repo_rev, quant) = match rest.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (repo, revision) = match repo_rev.split_once('@') {
            Some((r, v)) => (r, v),
            None => (repo_rev, "main"),
        };
        let (org, name) = repo
            .split_once('/')
            .ok_or_else(|| bad("the repository is not ORG/REPO"))?;
        if !plain(org) || !plain(name) {
            return Err(bad("the organization or repository name is empty or holds other characters than letters, digits, `-`, `_` and `.`"));
        }
        if !plain(revision) {
            return Err(bad("the revision is empty or holds other characters than letters, digits, `-`, `_` and `.`"));
        }
        if let Some(q) = quant {
            if !plain(q) {
                return Err(bad("the quant tag is empty or holds other characters than letters, digits, `-`, `_` and `.`"));
            }
        }
        Ok(HfRef {
            repo: repo.to_string(),
            revision: revision.to_string(),
            quant: quant.map(str::to_string),
        })
    }

    /// The repository's folder in the cache: `models--ORG--REPO`.
    pub fn cache_dir_name(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }

    /// The name back as `hf:ORG/REPO[@REVISION][:QUANT]`.
    pub fn display(&self) -> String {
        let mut s = format!("{HF_PREFIX}{}", self.repo);
        if self.revision != "main" {
            s.push('@');
            s.push_str(&self.revision);
        }
        if let Some(q) = &self.quant {
            s.push(':');
            s.push_str(q);
        }
        s
    }
}

/// One GGUF model among a repository's files: one file, or a split set's parts (those
/// listed, and how many there should be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufModel {
    /// The folder inside the repository, `""` or ending in `/`.
    dir: String,
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Single(String),
    Set {
        prefix: String,
        count: usize,
        present: BTreeSet<usize>,
    },
}

impl GgufModel {
    /// The file to open: the file, or the set's first part (a path inside the repository).
    pub fn first(&self) -> String {
        match &self.kind {
            Kind::Single(f) => format!("{}{f}", self.dir),
            Kind::Set { prefix, count, .. } => {
                format!("{}{}", self.dir, part_name(prefix, 0, *count))
            }
        }
    }

    /// Every file of the model, in order (a set's parts whether listed or not).
    pub fn files(&self) -> Vec<String> {
        match &self.kind {
            Kind::Single(f) => vec![format!("{}{f}", self.dir)],
            Kind::Set { prefix, count, .. } => (0..*count)
                .map(|i| format!("{}{}", self.dir, part_name(prefix, i, *count)))
                .collect(),
        }
    }

    /// The parts of a set that were not among the files.
    pub fn missing(&self) -> Vec<String> {
        match &self.kind {
            Kind::Single(_) => Vec::new(),
            Kind::Set {
                prefix,
                count,
                present,
            } => (0..*count)
                .filter(|i| !present.contains(i))
                .map(|i| format!("{}{}", self.dir, part_name(prefix, i, *count)))
                .collect(),
        }
    }

    /// The model's name: the file's stem, or the set's prefix.
    pub fn name(&self) -> String {
        match &self.kind {
            Kind::Single(f) => f.get(..f.len() - ".gguf".len()).unwrap_or(f).to_string(),
            Kind::Set { prefix, .. } => prefix.clone(),
        }
    }

    /// The pieces of its path that a quant tag is matched against.
    fn pieces(&self) -> Vec<String> {
        pieces(&format!("{}{}", self.dir, self.name()))
    }

    /// Whether quant tag `quant` names it (see the module docs).
    pub fn matches_quant(&self, quant: &str) -> bool {
        let want = pieces(quant);
        let have = self.pieces();
        !want.is_empty()
            && have
                .windows(want.len())
                .any(|w| w.iter().zip(&want).all(|(a, b)| a.eq_ignore_ascii_case(b)))
    }

    /// The quant tag its name carries (the last piece that reads as one: `Q4_K_M`, `IQ2_XS`,
    /// `F16`, `BF16`, ...), if any.
    pub fn quant(&self) -> Option<String> {
        self.pieces()
            .into_iter()
            .rev()
            .find(|p| looks_like_quant(p))
    }
}

fn pieces(s: &str) -> Vec<String> {
    s.split(['-', '.', '/'])
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

fn looks_like_quant(p: &str) -> bool {
    let u = p.to_ascii_uppercase();
    let digit_after = |prefix: &str| {
        u.strip_prefix(prefix)
            .and_then(|r| r.chars().next())
            .is_some_and(|c| c.is_ascii_digit())
    };
    matches!(u.as_str(), "F16" | "F32" | "BF16" | "FP16" | "MXFP4")
        || digit_after("Q")
        || digit_after("IQ")
        || digit_after("TQ")
}

/// The GGUF models among `files` (paths inside a repository, `/`-separated): each `.gguf`
/// file not a projector (`mmproj*`), a split set's parts grouped as one, in name order.
pub fn gguf_models(files: &[String]) -> Vec<GgufModel> {
    let mut singles = Vec::new();
    let mut sets: BTreeMap<(String, String, usize), BTreeSet<usize>> = BTreeMap::new();
    for f in files {
        let (dir, name) = match f.rsplit_once('/') {
            Some((d, n)) => (format!("{d}/"), n),
            None => (String::new(), f.as_str()),
        };
        let lower = name.to_ascii_lowercase();
        if !lower.ends_with(".gguf") || lower.starts_with("mmproj") || lower.contains("-mmproj") {
            continue;
        }
        match parse_name(name) {
            Some((prefix, no, count)) => {
                sets.entry((dir, prefix.to_string(), count))
                    .or_default()
                    .insert(no);
            }
            None => singles.push(GgufModel {
                dir,
                kind: Kind::Single(name.to_string()),
            }),
        }
    }
    let mut all: Vec<GgufModel> = singles;
    all.extend(
        sets.into_iter()
            .map(|((dir, prefix, count), present)| GgufModel {
                dir,
                kind: Kind::Set {
                    prefix,
                    count,
                    present,
                },
            }),
    );
    all.sort_by_key(GgufModel::first);
    all
}

/// Why no single model could be picked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    #[error("it holds no GGUF file")]
    NoGguf,
    #[error("it holds {} GGUF models; name one with its quant tag (`:QUANT`): {}", .models.len(), .models.join(", "))]
    NeedQuant { models: Vec<String> },
    #[error("no GGUF file matches quant tag `{quant}`; it holds: {}", .models.join(", "))]
    NoQuant { quant: String, models: Vec<String> },
    #[error("quant tag `{quant}` matches several models: {}; give a longer tag", .models.join(", "))]
    Ambiguous { quant: String, models: Vec<String> },
    #[error("split set {first} lacks part(s) {}", .missing.join(", "))]
    MissingParts { first: String, missing: Vec<String> },
}

fn describe(m: &GgufModel) -> String {
    let mut s = m.first();
    if let Some(q) = m.quant() {
        s = format!("{q} ({s})");
    }
    if m.files().len() > 1 {
        s.push_str(&format!(" [{} parts]", m.files().len()));
    }
    s
}

/// The model `quant` names among `models` (with no tag, the only model), with every part of
/// a split set present.
///
/// # Errors
/// When none or several match, or a part of the chosen set is missing.
pub fn pick<'a>(models: &'a [GgufModel], quant: Option<&str>) -> Result<&'a GgufModel, PickError> {
    if models.is_empty() {
        return Err(PickError::NoGguf);
    }
    let all = || models.iter().map(describe).collect::<Vec<_>>();
    let chosen = match quant {
        None if models.len() == 1 => &models[0],
        None => return Err(PickError::NeedQuant { models: all() }),
        Some(q) => {
            let hits: Vec<&GgufModel> = models.iter().filter(|m| m.matches_quant(q)).collect();
            match hits[..] {
                [one] => one,
                [] => {
                    return Err(PickError::NoQuant {
                        quant: q.to_string(),
                        models: all(),
                    })
                }
                _ => {
                    return Err(PickError::Ambiguous {
                        quant: q.to_string(),
                        models: hits.iter().map(|m| describe(m)).collect(),
                    })
                }
            }
        }
    };
    let missing = chosen.missing();
    if !missing.is_empty() {
        return Err(PickError::MissingParts {
            first: chosen.first(),
            missing,
        });
    }
    Ok(chosen)
}

/// The files under `dir` (following links, at most four folders deep), as `/`-separated
/// paths relative to it, sorted; a dangling link is not a file.
pub fn relative_files(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, rel: &str, depth: usize, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(base.join(rel)) else {
            return;
        };
        for e in rd.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let r = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let p = base.join(&r);
            if p.is_dir() {
                if depth < 4 {
                    walk(base, &r, depth + 1, out);
                }
            } else if p.is_file() {
                out.push(r);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", 0, &mut out);
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn refs_parse_and_refuse_what_they_should() {
        assert_eq!(
            HfRef::parse("hf:org/Model-GGUF:Q4_K_M").unwrap(),
            HfRef {
                repo: "org/Model-GGUF".into(),
                revision: "main".into(),
                quant: Some("Q4_K_M".into())
            }
        );
        let r = HfRef::parse("hf:org/m@v1.0").unwrap();
        assert_eq!((r.revision.as_str(), r.quant.as_deref()), ("v1.0", None));
        assert_eq!(r.cache_dir_name(), "models--org--m");
        assert_eq!(r.display(), "hf:org/m@v1.0");
        for bad in [
            "org/m",
            "hf:org",
            "hf:org/../x",
            "hf:/m",
            "hf:org/m:",
            "hf:org/m@:Q4",
            "hf:org/m:Q4/../../x",
            "hf:org/a b",
        ] {
            assert!(HfRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quant_tags_pick_files_and_sets() {
        let files = names(&[
            "README.md",
            "Model-Q4_K_M.gguf",
            "Model-Q4_K_S.gguf",
            "Model.F16.gguf",
            "mmproj-Model-F16.gguf",
            "Q8_0/Model-Q8_0-00001-of-00002.gguf",
            "Q8_0/Model-Q8_0-00002-of-00002.gguf",
            "Model-UD-Q2_K_XL.gguf",
        ]);
        let models = gguf_models(&files);
        assert_eq!(models.len(), 5, "{models:?}");
        assert_eq!(
            pick(&models, Some("q4_k_m")).unwrap().first(),
            "Model-Q4_K_M.gguf"
        );
        assert_eq!(
            pick(&models, Some("F16")).unwrap().first(),
            "Model.F16.gguf"
        );
        assert_eq!(
            pick(&models, Some("UD-Q2_K_XL")).unwrap().first(),
            "Model-UD-Q2_K_XL.gguf"
        );
        let set = pick(&models, Some("Q8_0")).unwrap();
        assert_eq!(
            set.files(),
            [
                "Q8_0/Model-Q8_0-00001-of-00002.gguf",
                "Q8_0/Model-Q8_0-00002-of-00002.gguf"
            ]
        );
        assert_eq!(set.quant().as_deref(), Some("Q8_0"));
        assert!(matches!(
            pick(&models, Some("Q4_K")),
            Err(PickError::NoQuant { .. })
        ));
        assert!(matches!(
            pick(&models, Some("Model")),
            Err(PickError::Ambiguous { .. })
        ));
        let e = pick(&models, None).unwrap_err().to_string();
        assert!(e.contains("5 GGUF models") && e.contains("Q4_K_S"), "{e}");
        assert!(matches!(pick(&[], None), Err(PickError::NoGguf)));
    }

    #[test]
    fn a_set_with_a_part_missing_is_refused_naming_it() {
        let files = names(&["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"]);
        let models = gguf_models(&files);
        let e = pick(&models, None).unwrap_err();
        assert_eq!(
            e,
            PickError::MissingParts {
                first: "m-00001-of-00003.gguf".into(),
                missing: vec!["m-00002-of-00003.gguf".into()]
            }
        );
    }
}

//! Split GGUF sets: a model too large for one file ships as `NAME-00001-of-00003.gguf`,
//! `NAME-00002-of-00003.gguf`, ..., as llama.cpp's `gguf-split` writes them. Every part is a
//! GGUF file of its own with `split.no` (its number from 0), `split.count` (the parts in the
//! set) and `split.tensors.count` (the tensors of the whole set); the first part holds the
//! model's metadata, and each tensor is in exactly one part. Given any part, the others are
//! found by the set's names beside it. A set is refused, naming the file, when a part is
//! missing, when its parts disagree on the part count or the tensor count (two sets mixed in
//! one folder), when a part's number is not the one its name says, or when a tensor is in two
//! parts.

use std::path::{Path, PathBuf};

use super::{GgufError, Metadata};

/// `split.no`: the part's number, from 0.
pub const KEY_NO: &str = "split.no";
/// `split.count`: the parts in the set.
pub const KEY_COUNT: &str = "split.count";
/// `split.tensors.count`: the tensors of the whole set.
pub const KEY_TENSORS: &str = "split.tensors.count";

/// Most parts of a set.
const MAX_PARTS: usize = 99_999;

/// A part's place in its set, as its metadata says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Its number, from 0.
    pub no: usize,
    /// The parts in the set.
    pub count: usize,
}

fn set_err(path: &Path, problem: String) -> GgufError {
    GgufError::Set {
        path: path.display().to_string(),
        problem,
    }
}

/// The name of part `no` (from 0) of `count` of the set whose files start with `prefix`.
pub fn part_name(prefix: &str, no: usize, count: usize) -> String {
    format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1)
}

/// The set prefix, part number (from 0) and part count a file's name says
/// (`NAME-00002-of-00003.gguf`: `NAME`, 1, 3), if it follows the pattern.
pub fn parse_name(name: &str) -> Option<(&str, usize, usize)> {
    let stem = name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) || prefix.is_empty() {
        return None;
    }
    let (no, count): (usize, usize) = (no.parse().ok()?, count.parse().ok()?);
    (1..=count).contains(&no).then_some((prefix, no - 1, count))
}

/// Every file of the set `path` is a part of, in order, when its name says it is one (the
/// files need not exist).
pub fn sibling_paths(path: &Path) -> Option<Vec<PathBuf>> {
    let name = path.file_name()?.to_str()?;
    let (prefix, _, count) = parse_name(name)?;
    let dir = path.parent().unwrap_or(Path::new(""));
    Some(
        (0..count)
            .map(|i| dir.join(part_name(prefix, i, count)))
            .collect(),
    )
}

impl Split {
    /// The place of the file at `path` with metadata `md` in its set; `None` for a file that
    /// is not part of a set (no `split.count`, or a count of 1).
    ///
    /// # Errors
    /// When the keys are malformed.
    pub fn of(path: &Path, md: &Metadata) -> Result<Option<Self>, GgufError> {
        let Some(count) = md.opt_usize_max(KEY_COUNT, MAX_PARTS)? else {
            return Ok(None);
        };
        if count <= 1 {
            return Ok(None);
        }
        let no = md.opt_usize_max(KEY_NO, MAX_PARTS)?.ok_or_else(|| {
            set_err(
                path,
                format!("`{KEY_COUNT}` is {count} but `{KEY_NO}` is missing: a broken split set"),
            )
        })?;
        if no >= count {
            return Err(set_err(
                path,
                format!("it says it is part {} of a set of {count}", no + 1),
            ));
        }
        Ok(Some(Split { no, count }))
    }

    /// The set's files, in order, from the name of the part at `path`.
    ///
    /// # Errors
    /// When the name does not follow the set's pattern, or says another place in the set
    /// than the metadata.
    pub fn paths(&self, path: &Path) -> Result<Vec<PathBuf>, GgufError> {
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_name);
        let Some((_, no, count)) = named else {
            return Err(set_err(
                path,
                format!(
                    "this file is part {} of a split set of {}, but its name does not follow \
                     NAME-{:05}-of-{:05}.gguf, so its other parts cannot be found; name the \
                     parts as llama.cpp's gguf-split wrote them",
                    self.no + 1,
                    self.count,
                    self.no + 1,
                    self.count
                ),
            ));
        };
        if (no, count) != (self.no, self.count) {
            return Err(set_err(
                path,
                format!(
                    "its name says part {} of {count}, but the file says it is part {} of {} \
                     (`{KEY_NO}`, `{KEY_COUNT}`): a renamed part, or parts of two sets",
                    no + 1,
                    self.no + 1,
                    self.count
                ),
            ));
        }
        Ok(sibling_paths(path).expect("the name was parsed above"))
    }

    /// Checks that the part at `path` (number `i` of the set, metadata `md`) belongs with
    /// the set's first part at `first` (metadata `first_md`).
    ///
    /// # Errors
    /// When it says another place or count, or another tensor count than the first part.
    pub fn check_part(
        &self,
        i: usize,
        (path, md): (&Path, &Metadata),
        (first, first_md): (&Path, &Metadata),
    ) -> Result<(), GgufError> {
        match Split::of(path, md)? {
            Some(s) if s.count != self.count => Err(set_err(
                path,
                format!(
                    "it says the set has {} parts, the others say {}: parts of two different \
                     sets in one folder; keep one set's parts together",
                    s.count, self.count
                ),
            )),
            Some(s) if s.no != i => Err(set_err(
                path,
                format!(
                    "its name says part {} but the file says it is part {} (`{KEY_NO}`): a \
                     renamed part, or parts of two sets",
                    i + 1,
                    s.no + 1
                ),
            )),
            Some(_) => Ok(()),
            None => Err(set_err(
                path,
                format!(
                    "it is named as part {} of a set of {} but is not a part of a split set \
                     (no `{KEY_COUNT}`)",
                    i + 1,
                    self.count
                ),
            )),
        }?;
        let theirs = first_md.opt_usize_max(KEY_TENSORS, usize::MAX)?;
        let mine = md.opt_usize_max(KEY_TENSORS, usize::MAX)?;
        if mine != theirs {
            return Err(set_err(
                path,
                format!(
                    "it says the set holds {} tensors, {} says {}: parts of two different \
                     sets in one folder; keep one set's parts together",
                    mine.map_or("no count of".into(), |n| n.to_string()),
                    first.display(),
                    theirs.map_or("none".into(), |n| n.to_string())
                ),
            ));
        }
        Ok(())
    }
}

/// The error for part `i` (from 0) of `count`, at `path`, missing.
pub fn missing(path: &Path, i: usize, count: usize, given: &Path) -> GgufError {
    set_err(
        path,
        format!(
            "part {} of {count} of the split set {} belongs to is missing; download every \
             part into the same folder",
            i + 1,
            given.display()
        ),
    )
}

/// The error for tensor `name` held by two parts.
pub fn twice(name: &str, a: &Path, b: &Path) -> GgufError {
    set_err(
        b,
        format!(
            "tensor `{name}` is in this part and in {} too: parts of two different sets, or \
             a broken split",
            a.display()
        ),
    )
}

/// Checks the set's tensors (`found` in all its parts) against the first part's
/// `split.tensors.count`.
///
/// # Errors
/// When they differ.
pub fn check_count(first: &Path, md: &Metadata, found: usize) -> Result<(), GgufError> {
    match md.opt_usize_max(KEY_TENSORS, usize::MAX)? {
        Some(n) if n != found => Err(set_err(
            first,
            format!(
                "the set says it holds {n} tensors (`{KEY_TENSORS}`) but its parts hold \
                 {found}: parts of two different sets, or a broken split"
            ),
        )),
        _ => Ok(()),
    }
}

//! GGUF metadata: the typed key/value section of the header, with getters that convert
//! between the integer widths writers use interchangeably and that name the key and the
//! type they found when a value is missing or of the wrong kind.

use std::collections::HashMap;

use super::GgufError;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(MetaArray),
}

/// A metadata array, stored by element type so a 262,144-entry vocabulary stays compact.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<MetaArray>),
}

impl MetaArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn type_name(&self) -> &'static str {
        match self {
            MetaArray::U8(_) => "array of u8",
            MetaArray::I8(_) => "array of i8",
            MetaArray::U16(_) => "array of u16",
            MetaArray::I16(_) => "array of i16",
            MetaArray::U32(_) => "array of u32",
            MetaArray::I32(_) => "array of i32",
            MetaArray::U64(_) => "array of u64",
            MetaArray::I64(_) => "array of i64",
            MetaArray::F32(_) => "array of f32",
            MetaArray::F64(_) => "array of f64",
            MetaArray::Bool(_) => "array of bool",
            MetaArray::String(_) => "array of string",
            MetaArray::Array(_) => "array of array",
        }
    }

    /// The elements as `i64`, when the array holds integers of any width.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match self {
            MetaArray::U8(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::I8(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::U16(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::I16(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::U32(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::I32(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::U64(v) => v.iter().map(|&x| x as i64).collect(),
            MetaArray::I64(v) => v.clone(),
            _ => return None,
        })
    }

    /// The elements as `f32`, when the array holds floats.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        Some(match self {
            MetaArray::F32(v) => v.clone(),
            MetaArray::F64(v) => v.iter().map(|&x| x as f32).collect(),
            _ => return None,
        })
    }
}

impl MetaValue {
    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(a) => a.type_name(),
        }
    }

    /// The value as an `i64`, when it is an integer of any width.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            MetaValue::U8(x) => x as i64,
            MetaValue::I8(x) => x as i64,
            MetaValue::U16(x) => x as i64,
            MetaValue::I16(x) => x as i64,
            MetaValue::U32(x) => x as i64,
            MetaValue::I32(x) => x as i64,
            MetaValue::U64(x) => i64::try_from(x).ok()?,
            MetaValue::I64(x) => x,
            _ => return None,
        })
    }

    /// The value as an `f64`, when it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(x) => Some(x as f64),
            MetaValue::F64(x) => Some(x),
            _ => self.as_i64().map(|x| x as f64),
        }
    }
}

/// The metadata section of a GGUF file, in file order with a name index.
#[derive(Debug, Clone, Default)]
pub struct Metadata {
    pub(crate) entries: Vec<(String, MetaValue)>,
    pub(crate) index: HashMap<String, usize>,
    pub(crate) path: String,
}

impl Metadata {
    /// Builds metadata from entries (later duplicates of a key replace earlier ones).
    pub fn from_entries(path: &str, entries: Vec<(String, MetaValue)>) -> Self {
        let mut index = HashMap::with_capacity(entries.len());
        for (i, (k, _)) in entries.iter().enumerate() {
            index.insert(k.clone(), i);
        }
        Metadata {
            entries,
            index,
            path: path.to_string(),
        }
    }

    /// All entries in file order.
    pub fn entries(&self) -> &[(String, MetaValue)] {
        &self.entries
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    fn err(&self, key: &str, problem: String) -> GgufError {
        GgufError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            problem,
        }
    }

    fn required(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key)
            .ok_or_else(|| self.err(key, "is missing".into()))
    }

    /// An integer value of any width, as `u64`.
    ///
    /// # Errors
    /// When the key is missing, not an integer, or negative.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.required(key)?;
        v.as_i64()
            .and_then(|x| u64::try_from(x).ok())
            .ok_or_else(|| {
                self.err(
                    key,
                    format!("expected a non-negative integer, found {}", v.type_name()),
                )
            })
    }

    /// An integer value as `usize`, checked against `max` (hostile files carry absurd sizes).
    ///
    /// # Errors
    /// When the key is missing, not an integer, or above `max`.
    pub fn usize_max(&self, key: &str, max: usize) -> Result<usize, GgufError> {
        let v = self.u64(key)?;
        if v > max as u64 {
            return Err(self.err(
                key,
                format!("value {v} is larger than the supported maximum {max}"),
            ));
        }
        Ok(v as usize)
    }

    /// An optional integer value as `usize` (`None` when absent).
    ///
    /// # Errors
    /// When present but not an integer or above `max`.
    pub fn opt_usize_max(&self, key: &str, max: usize) -> Result<Option<usize>, GgufError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.usize_max(key, max).map(Some)
    }

    /// A float value (f32, f64 or an integer).
    ///
    /// # Errors
    /// When the key is missing or not a number.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.required(key)?;
        v.as_f64()
            .ok_or_else(|| self.err(key, format!("expected a number, found {}", v.type_name())))
    }

    /// An optional float value.
    ///
    /// # Errors
    /// When present but not a number.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.f64(key).map(Some)
    }

    /// A bool value, if present.
    ///
    /// # Errors
    /// When present but not a bool.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(key, format!("expected a bool, found {}", v.type_name()))),
        }
    }

    /// A string value.
    ///
    /// # Errors
    /// When the key is missing or not a string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        match self.required(key)? {
            MetaValue::String(s) => Ok(s),
            v => Err(self.err(key, format!("expected a string, found {}", v.type_name()))),
        }
    }

    /// An optional string value.
    ///
    /// # Errors
    /// When present but not a string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.str(key).map(Some)
    }

    /// An array value.
    ///
    /// # Errors
    /// When the key is missing or not an array.
    pub fn array(&self, key: &str) -> Result<&MetaArray, GgufError> {
        match self.required(key)? {
            MetaValue::Array(a) => Ok(a),
            v => Err(self.err(key, format!("expected an array, found {}", v.type_name()))),
        }
    }

    /// An array of strings.
    ///
    /// # Errors
    /// When the key is missing or not an array of strings.
    pub fn str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.array(key)? {
            MetaArray::String(v) => Ok(v),
            a => Err(self.err(
                key,
                format!("expected an array of string, found {}", a.type_name()),
            )),
        }
    }

    /// An array of integers of any width, as `i64`.
    ///
    /// # Errors
    /// When the key is missing or not an integer array.
    pub fn int_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let a = self.array(key)?;
        a.to_i64_vec().ok_or_else(|| {
            self.err(
                key,
                format!("expected an array of integers, found {}", a.type_name()),
            )
        })
    }

    /// An array of floats, as `f32`.
    ///
    /// # Errors
    /// When the key is missing or not a float array.
    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        let a = self.array(key)?;
        a.to_f32_vec().ok_or_else(|| {
            self.err(
                key,
                format!("expected an array of floats, found {}", a.type_name()),
            )
        })
    }
}

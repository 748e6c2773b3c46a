//! Lists that chat templates change in place, as Python's Jinja lets them: Kimi K2's template
//! keeps the ids of its tool calls in `namespace(ids=[])` and calls `ids.append(..)` and
//! `ids.pop(0)` on them. minijinja's values are immutable, so [`namespace`] (which replaces
//! the built-in) turns each list it is given into a [`MutableList`], a sequence object with
//! `append` and `pop`; everything else about the namespace is minijinja's.

use std::sync::{Arc, Mutex};

use minijinja::value::{from_args, Enumerator, Object, ObjectRepr, Value, ValueOrKwargs};
use minijinja::{Error, ErrorKind, State};

/// A list a template may append to and pop from.
#[derive(Debug, Default)]
pub(crate) struct MutableList(Mutex<Vec<Value>>);

impl MutableList {
    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Object for MutableList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.items();
        let i = i64::try_from(key.clone()).ok()?;
        let i = if i < 0 { items.len() as i64 + i } else { i };
        usize::try_from(i).ok().and_then(|i| items.get(i).cloned())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Seq(self.items().len())
    }

    fn call_method(
        self: &Arc<Self>,
        _state: &mut State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> Result<Value, Error> {
        match method {
            "append" => {
                let (v,): (Value,) = from_args(args)?;
                // a list inside a list that can change could come to hold itself, and
                // printing it would never end
                if v.downcast_object_ref::<MutableList>().is_some() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "a namespace list cannot hold another namespace list",
                    ));
                }
                self.items().push(v);
                Ok(Value::from(()))
            }
            "pop" => {
                let (at,): (Option<i64>,) = from_args(args)?;
                let mut items = self.items();
                let len = items.len() as i64;
                let at = at.unwrap_or(-1);
                let i = if at < 0 { len + at } else { at };
                if !(0..len).contains(&i) {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("pop index {at} out of range for a list of {len}"),
                    ));
                }
                Ok(items.remove(i as usize))
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        }
    }
}

/// `namespace(...)` whose lists can be changed in place.
pub(crate) fn namespace(defaults: Option<ValueOrKwargs>) -> Result<Value, Error> {
    let Some(defaults) = defaults else {
        return minijinja::functions::namespace(None);
    };
    let v = defaults.into_value();
    let pairs: std::collections::BTreeMap<String, Value> = match v.as_object() {
        Some(o) if matches!(o.repr(), ObjectRepr::Map) => o
            .try_iter_pairs()
            .map(|p| p.map(|(k, v)| (k.to_string(), mutable(v))).collect())
            .unwrap_or_default(),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "namespace() expects keyword arguments or a map, got {}",
                    v.kind()
                ),
            ))
        }
    };
    let (d,): (Option<ValueOrKwargs>,) = from_args(&[Value::from(pairs)])?;
    minijinja::functions::namespace(d)
}

/// `v` as a [`MutableList`] when it is a list, else as it is.
fn mutable(v: Value) -> Value {
    match v.as_object() {
        Some(o)
            if matches!(o.repr(), ObjectRepr::Seq)
                && v.downcast_object_ref::<MutableList>().is_none() =>
        {
            let items: Vec<Value> = v.try_iter().map(|i| i.collect()).unwrap_or_default();
            Value::from_object(MutableList(Mutex::new(items)))
        }
        _ => v,
    }
}

//! placeholder

pub mod catalog;
pub mod source;

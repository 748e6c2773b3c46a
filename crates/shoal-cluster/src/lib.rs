//! A shoal node in its cluster: who it is, how it finds the other nodes, how it proves it
//! belongs (and keeps strangers out), who is alive, what each node and link can do, and the
//! cluster state every node holds a copy of.

pub mod discovery;
pub mod facts;
pub mod identity;
pub mod instances;
pub mod membership;
pub mod mesh;
pub mod node;
pub mod protocol;
pub mod seal;
pub mod secret;
pub mod session;

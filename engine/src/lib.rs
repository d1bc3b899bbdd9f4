//! pghydrate's engine: everything the CLI and the Lambdas do, as a library.
//!
//! - [`catalog`] discovers databases and every relation fork with storage, and builds a [`plan::Plan`];
//! - [`warm`] reads the plan's block ranges with pg_prewarm in parallel sessions, as many as
//!   [`adaptive`] finds the volume rewards;
//! - [`bounded`] gives every statement a client-side bound (half-open connections);
//! - [`maintain`] runs ANALYZE / VACUUM ANALYZE;
//! - [`run::RunState`] is a whole hydration as one serializable value (the continuation);
//! - [`report`] turns a state into the report;
//! - [`sql`] states where executed SQL text may come from (never from state), and pins every session's
//!   search path.

pub mod adaptive;
#[cfg(feature = "aws")]
pub mod aws;
pub mod bounded;
pub mod catalog;
pub mod connect;
pub mod error;
pub mod events;
pub mod hotset;
pub mod maintain;
pub mod pattern;
pub mod plan;
pub mod report;
pub mod run;
pub mod sql;
pub mod warm;
pub mod workflow;

pub use connect::{ConnectionSpec, TlsMode};
pub use error::{Error, Result};

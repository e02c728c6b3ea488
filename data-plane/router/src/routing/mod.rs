//! The routing state requests read, and what keeps it current: the immutable routing table
//! (`table`), what outlives a table per instance (`cells`: load, ejection, bounded-load
//! memories), membership (`membership`: sync messages or a static file → table) and the
//! control-plane stream (`sync_client`).

pub(crate) mod cells;
pub(crate) mod membership;
pub(crate) mod static_file;
pub(crate) mod sync_client;
pub(crate) mod table;

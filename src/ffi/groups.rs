//! Groups: calls between rdist_group_start and rdist_group_end run
//! together.

use super::boundary;
use super::types::*;
use crate::comm::group;

/// Starts a group (per thread, may nest): calls until the matching
/// rdist_group_end only queue (their buffers must stay valid), so that e.g.
/// a rank can send to and receive from the same peer without deadlock.
#[no_mangle]
pub extern "C" fn rdist_group_start() -> rdist_result_t {
    boundary("rdist_group_start", None, || {
        group::start();
        Ok(())
    })
}

/// Ends a group; the outermost end runs every queued call and returns when
/// all have completed, reporting the first error.
#[no_mangle]
pub extern "C" fn rdist_group_end() -> rdist_result_t {
    // SAFETY: the C contract keeps queued buffers valid until here.
    boundary("rdist_group_end", None, || unsafe { group::end() })
}

//! Dissemination barrier: in round k every rank signals rank + 2^k and
//! waits for rank - 2^k; after ceil(log2 n) rounds everyone has (indirectly)
//! heard from everyone.

use super::Link;
use crate::error::Result;

pub fn barrier(link: &mut Link<'_>) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let mut dist = 1;
    while dist < n {
        link.send_recv((r + dist) % n, &[], (r + n - dist) % n, &mut [])?;
        dist <<= 1;
    }
    Ok(())
}

//! An in-memory transport for the algorithms' unit tests: one thread per
//! rank, sends queued without bound (so an exchange posts every send, then
//! takes every receive in order), and a receive that does not match the
//! size sent fails the test instead of passing garbage on.

use super::Link;
use crate::descriptor::{Desc, OpKind};
use crate::error::Result;
use crate::reduce;
use crate::transport::{Dir, Transport, Xfer};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

struct Mock {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
}

impl Transport for Mock {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        for x in xfers.iter() {
            if let Dir::Send(data) = &x.dir {
                self.to[x.peer].send(data.to_vec()).expect("peer alive");
            }
        }
        for x in xfers.iter_mut() {
            let got = match &x.dir {
                Dir::Send(_) => continue,
                _ => self.from[x.peer]
                    .recv_timeout(Duration::from_secs(20))
                    .unwrap_or_else(|_| {
                        panic!("rank {} waited 20 s for rank {}", self.rank, x.peer)
                    }),
            };
            match &mut x.dir {
                Dir::Recv(buf) => {
                    assert_eq!(got.len(), buf.len(), "rank {} from {}", self.rank, x.peer);
                    buf.copy_from_slice(&got);
                }
                Dir::RecvReduce(buf, dtype, op) => {
                    assert_eq!(got.len(), buf.len(), "rank {} from {}", self.rank, x.peer);
                    reduce::reduce_into(buf, &got, *dtype, *op);
                }
                Dir::Send(_) => {}
            }
        }
        Ok(())
    }
}

/// Runs `f` on `n` ranks at once, each with a `Link` over the mock
/// transport; returns what each rank returned, in rank order.
pub fn world<T: Send + 'static>(
    n: usize,
    f: impl Fn(&mut Link<'_>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let mut senders: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..n).map(|_| vec![None; n]).collect();
    let mut receivers: Vec<Vec<Option<Receiver<Vec<u8>>>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for a in 0..n {
        for b in 0..n {
            let (s, r) = channel();
            senders[a][b] = Some(s);
            receivers[b][a] = Some(r);
        }
    }
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (to, from))| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut t = Mock {
                    rank,
                    to: to.into_iter().map(Option::unwrap).collect(),
                    from: from.into_iter().map(Option::unwrap).collect(),
                };
                let mut scratch = Vec::new();
                let mut link = Link::new(&mut t, Desc::new(OpKind::AllReduce, 0), &mut scratch);
                f(&mut link)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect()
}

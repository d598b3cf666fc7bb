//! Tagged point-to-point on host buffers, as the backend offers it: the
//! transport's endpoint matches and moves the messages (in their own
//! context, on the pairs' connections); here each call is numbered and
//! traced in the communicator's ledger, like every other call.

use super::ledger::Ledger;
use crate::error::Result;
use crate::transport::endpoint::Endpoint;
use crate::transport::tagged::{Incoming, Outgoing, Status, Ticket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A communicator's tagged calls.
pub(crate) struct Messages {
    endpoint: Arc<Endpoint>,
    ledger: Arc<Ledger>,
}

/// A posted tagged call.
pub struct Posted {
    ticket: Ticket,
    /// What the trace records of it, when tracing: boxed, so that the
    /// request a small message makes stays small (it is moved through
    /// every layer, and into its handle).
    traced: Option<Box<Traced>>,
}

/// A posted call as the trace records it.
struct Traced {
    /// Its number in the ledger.
    seq: u64,
    name: &'static str,
    bytes: usize,
    started: Instant,
    recorded: AtomicBool,
}

impl Messages {
    pub(crate) fn new(endpoint: Arc<Endpoint>, ledger: Arc<Ledger>) -> Messages {
        Messages { endpoint, ledger }
    }

    /// A posted call, numbered now; traced from `since` (when its caller
    /// began waiting for it) or from now.
    fn posted(
        &self,
        ticket: Ticket,
        name: &'static str,
        bytes: usize,
        since: Option<Instant>,
    ) -> Posted {
        // Numbered for the trace, which is the only reader of the number
        // (an atomic add a call saved otherwise).
        let traced = self.ledger.tracing().then(|| {
            Box::new(Traced {
                seq: self.ledger.next_tagged(),
                name,
                bytes,
                started: since.unwrap_or_else(Instant::now),
                recorded: AtomicBool::new(false),
            })
        });
        Posted { ticket, traced }
    }

    /// Posts a send; it starts at once. `blocking`: the caller waits for
    /// it at once.
    ///
    /// # Safety
    /// `msg.buf` valid for reads until the call completes.
    pub(crate) unsafe fn send(&self, msg: Outgoing, blocking: bool) -> Result<Posted> {
        let ticket = self.endpoint.send(msg, blocking)?;
        Ok(self.posted(ticket, "send", msg.buf.len(), None))
    }

    /// Posts a receive; it matches at once if its message arrived.
    /// `blocking` as for `send`.
    ///
    /// # Safety
    /// `r.buf` valid for writes, and untouched, until the call completes.
    pub(crate) unsafe fn recv(&self, r: Incoming, blocking: bool) -> Result<Posted> {
        let ticket = self.endpoint.recv(r, blocking)?;
        Ok(self.posted(ticket, "recv", r.buf.len(), None))
    }

    /// A blocking send: complete at once with no ticket when the
    /// endpoint can write it whole now, else posted and waited for.
    ///
    /// # Safety
    /// `msg.buf` valid for reads until this returns.
    pub(crate) unsafe fn send_blocking(&self, msg: Outgoing) -> Result<Status> {
        if let Some(status) = self.send_now(msg) {
            return Ok(status);
        }
        let p = self.send(msg, true)?;
        self.wait(&p)
    }

    /// A send complete on return, numbered and traced, when the endpoint
    /// writes it whole now (`Endpoint::send_now`); None: post it.
    ///
    /// # Safety
    /// `msg.buf` valid for reads until this returns.
    pub(crate) unsafe fn send_now(&self, msg: Outgoing) -> Option<Status> {
        let started = self.ledger.tracing().then(Instant::now);
        let status = self.endpoint.send_now(msg)?;
        self.note_now("send", msg.buf.len(), started, true);
        Some(status)
    }

    /// A blocking receive: taken straight from its peer's connection
    /// when nothing else is pending and its message comes within the spin
    /// window, else posted and waited for.
    ///
    /// # Safety
    /// `r.buf` valid for writes, and untouched, until this returns.
    pub(crate) unsafe fn recv_blocking(&self, r: Incoming) -> Result<Status> {
        let started = self.ledger.tracing().then(Instant::now);
        // Not taken: posted, and waited for within the timeout from when
        // the wait began (the look counts), traced from the call's start.
        let since = match self.endpoint.recv_now(r) {
            Ok(result) => {
                self.note_now("recv", r.buf.len(), started, result.is_ok());
                return result;
            }
            Err(since) => since,
        };
        let ticket = self.endpoint.recv(r, true)?;
        let p = self.posted(ticket, "recv", r.buf.len(), started);
        let result = self.endpoint.wait_since(&p.ticket, since);
        self.note(&p, result.is_ok());
        result
    }

    /// Numbers and traces a call that completed without being posted
    /// (when tracing).
    fn note_now(&self, name: &'static str, bytes: usize, started: Option<Instant>, ok: bool) {
        if let Some(started) = started {
            let seq = self.ledger.next_tagged();
            self.ledger.record_tagged(name, seq, bytes, started, ok);
        }
    }

    /// Waits for a posted call, bounded by the timeout.
    pub(crate) fn wait(&self, p: &Posted) -> Result<Status> {
        let r = self.endpoint.wait(&p.ticket);
        self.note(p, r.is_ok());
        r
    }

    /// The call's result once complete; never blocks.
    pub(crate) fn test(&self, p: &Posted) -> Option<Result<Status>> {
        let r = self.endpoint.test(&p.ticket)?;
        self.note(p, r.is_ok());
        Some(r)
    }

    /// Whether posted call `p` completed, and is traced if it is to be.
    pub(crate) fn settled(&self, p: &Posted) -> bool {
        p.ticket.done.is_finished()
            && p.traced
                .as_ref()
                .is_none_or(|t| t.recorded.load(Ordering::Relaxed))
    }

    /// Records a completed call in the trace, once.
    fn note(&self, p: &Posted, ok: bool) {
        if let Some(t) = &p.traced {
            if !t.recorded.swap(true, Ordering::Relaxed) {
                self.ledger
                    .record_tagged(t.name, t.seq, t.bytes, t.started, ok);
            }
        }
    }
}

//! The first bytes of every peer connection, both sides: the hello (see
//! `mesh`), and with an `auth_token` the challenge-response of
//! `crate::auth` around it, so that only ranks that know the token are
//! counted as ranks.
//!
//! Connecting side: hello (byte 37 says whether a nonce follows), then its
//! 32-byte nonce. Answering side, with a token: `CHALLENGE`, its nonce and
//! its proof; connecting side: its proof; answering side: `ACCEPTED`, or
//! `REJECTED` and it hangs up. The hello is what both proofs are about.
//! Without tokens on both sides nothing follows the hello here.
//!
//! The answering side reads without blocking (a [`Greeting`] per accepted
//! connection, advanced whenever bytes arrive), so strangers that send
//! nothing, or send slowly, delay no one: each is dropped at its deadline.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::signal::{readable_by, AbortSignal};
use crate::auth::{self, Side, Token, NONCE_BYTES, PROOF_BYTES};

/// Bytes of the hello (its layout is `mesh`'s).
pub const HELLO_BYTES: usize = 40;

/// Byte 37 of the hello: a nonce follows (the sender has a token).
pub const HELLO_AUTH_FLAG: usize = 37;

/// What the answering side says before any verdict.
pub const CHALLENGE: u8 = 0x10;
pub const ACCEPTED: u8 = 0x11;
/// The answering side has a token and the hello came without a nonce.
pub const NEEDS_TOKEN: u8 = 0x13;
/// The hello came with a nonce and the answering side has no token.
pub const HAS_NO_TOKEN: u8 = 0x14;
pub const REJECTED: u8 = 0x15;

/// How long an accepted connection has to say its hello (and prove the
/// token): real ranks do it at once.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// Why the connecting side's introduction failed.
#[derive(Debug)]
pub enum Refusal {
    /// The peer answered something this side cannot accept (the message).
    Auth(String),
    Io(io::Error),
}

impl From<io::Error> for Refusal {
    fn from(e: io::Error) -> Refusal {
        Refusal::Io(e)
    }
}

/// Connecting side: sends `hello` (with the auth flag set when there is a
/// token) and, with a token, runs the challenge-response to its end.
/// Blocking, bounded by `deadline` (`TimedOut`), and by `abort` when
/// given (`Interrupted`).
pub fn introduce(
    stream: &mut TcpStream,
    hello: &[u8; HELLO_BYTES],
    token: Option<&Token>,
    deadline: Instant,
    abort: Option<&AbortSignal>,
) -> Result<(), Refusal> {
    let fd = stream.as_raw_fd();
    let answered = || readable_by(fd, deadline, abort);
    let Some(token) = token else {
        return Ok(stream.write_all(hello)?);
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))?;
    let mut hello = *hello;
    hello[HELLO_AUTH_FLAG] = 1;
    let ours = auth::nonce();
    let mut first = hello.to_vec();
    first.extend_from_slice(&ours);
    stream.write_all(&first)?;
    let mut status = [0u8; 1];
    answered()?;
    stream.read_exact(&mut status)?;
    match status[0] {
        CHALLENGE => {}
        HAS_NO_TOKEN => {
            return Err(Refusal::Auth(
                "it has no auth token, but this rank has one: give every rank the same \
                 auth_token (or RDIST_AUTH_TOKEN), or none"
                    .into(),
            ))
        }
        other => {
            return Err(Refusal::Auth(format!(
                "it answered the hello with {other:#x}"
            )))
        }
    }
    let mut challenge = [0u8; NONCE_BYTES + PROOF_BYTES];
    answered()?;
    stream.read_exact(&mut challenge)?;
    let (theirs, their_proof) = challenge.split_at(NONCE_BYTES);
    if !token.verify(Side::Answering, &hello, &ours, theirs, their_proof) {
        return Err(Refusal::Auth(
            "it does not know this job's auth token (its proof did not match): were the \
             ranks given different tokens?"
                .into(),
        ));
    }
    stream.write_all(&token.prove(Side::Connecting, &hello, &ours, theirs))?;
    answered()?;
    stream.read_exact(&mut status)?;
    match status[0] {
        ACCEPTED => Ok(()),
        _ => Err(Refusal::Auth(
            "it rejected this rank's proof of the auth token".into(),
        )),
    }
}

/// What the connecting side's first status byte says, when it is one of
/// the authentication answers rather than a verdict.
pub fn describe_status(status: u8) -> Option<&'static str> {
    match status {
        NEEDS_TOKEN => Some(
            "it requires an auth token and this rank has none: set auth_token (or \
             RDIST_AUTH_TOKEN) as the other ranks did",
        ),
        HAS_NO_TOKEN => Some("it has no auth token, but this rank has one"),
        REJECTED => Some("it rejected this rank's proof of the auth token"),
        _ => None,
    }
}

/// Answering side: one accepted connection on its way to a hello.
pub struct Greeting {
    stream: TcpStream,
    received: Vec<u8>,
    since: Instant,
    /// Our nonce, once the challenge is sent.
    ours: Option<[u8; NONCE_BYTES]>,
}

/// Where a greeting stands.
pub enum Greeted {
    /// Waiting for more bytes.
    Pending,
    /// The hello, authenticated when there is a token.
    Ready,
    /// Refused or broken: drop it.
    Dropped,
}

impl Greeting {
    /// Starts greeting an accepted connection (made non-blocking).
    pub fn new(stream: TcpStream) -> Option<Greeting> {
        stream.set_nonblocking(true).ok()?;
        Some(Greeting {
            stream,
            received: Vec::with_capacity(HELLO_BYTES + NONCE_BYTES + PROOF_BYTES),
            since: Instant::now(),
            ours: None,
        })
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// True once it has had `limit` to finish.
    pub fn expired(&self, now: Instant, limit: Duration) -> bool {
        now.duration_since(self.since) > limit
    }

    /// How many bytes the current step needs in all.
    fn wanted(&self, token: Option<&Token>) -> usize {
        if self.received.len() < HELLO_BYTES || self.received[HELLO_AUTH_FLAG] != 1 {
            // No nonce follows a hello without the flag.
            return HELLO_BYTES;
        }
        // With the flag a nonce follows; it is read even when this side has
        // no token, so that the answer is not lost to a reset on close.
        match (token, self.ours) {
            (None, _) | (Some(_), None) => HELLO_BYTES + NONCE_BYTES,
            (Some(_), Some(_)) => HELLO_BYTES + NONCE_BYTES + PROOF_BYTES,
        }
    }

    /// Reads what arrived (never past the current step, so nothing that
    /// follows the greeting is taken) and answers.
    pub fn advance(&mut self, token: Option<&Token>) -> Greeted {
        loop {
            let wanted = self.wanted(token);
            if self.received.len() < wanted {
                let mut chunk = [0u8; HELLO_BYTES + NONCE_BYTES + PROOF_BYTES];
                let room = wanted - self.received.len();
                match self.stream.read(&mut chunk[..room]) {
                    Ok(0) => return Greeted::Dropped,
                    Ok(n) => self.received.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Greeted::Pending,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => return Greeted::Dropped,
                }
                continue;
            }
            let flagged = self.received[HELLO_AUTH_FLAG] == 1;
            let Some(token) = token else {
                if flagged {
                    self.say(&[HAS_NO_TOKEN]);
                    return Greeted::Dropped;
                }
                return Greeted::Ready;
            };
            if !flagged {
                self.say(&[NEEDS_TOKEN]);
                return Greeted::Dropped;
            }
            let (hello, rest) = self.received.split_at(HELLO_BYTES);
            let (theirs, proof) = rest.split_at(NONCE_BYTES);
            match self.ours {
                None => {
                    let ours = auth::nonce();
                    let mut challenge = vec![CHALLENGE];
                    challenge.extend_from_slice(&ours);
                    challenge.extend_from_slice(&token.prove(
                        Side::Answering,
                        hello,
                        theirs,
                        &ours,
                    ));
                    self.ours = Some(ours);
                    if !self.say(&challenge) {
                        return Greeted::Dropped;
                    }
                }
                Some(ours) => {
                    if token.verify(Side::Connecting, hello, theirs, &ours, proof) {
                        return if self.say(&[ACCEPTED]) {
                            Greeted::Ready
                        } else {
                            Greeted::Dropped
                        };
                    }
                    self.say(&[REJECTED]);
                    return Greeted::Dropped;
                }
            }
        }
    }

    /// Writes a short answer whole (a fresh socket takes it at once);
    /// false when it could not.
    fn say(&mut self, bytes: &[u8]) -> bool {
        matches!(self.stream.write(bytes), Ok(n) if n == bytes.len())
    }

    /// The hello (with the auth flag cleared) and the stream, blocking again.
    pub fn finish(self) -> ([u8; HELLO_BYTES], TcpStream) {
        let mut hello = [0u8; HELLO_BYTES];
        hello.copy_from_slice(&self.received[..HELLO_BYTES]);
        hello[HELLO_AUTH_FLAG] = 0;
        let _ = self.stream.set_nonblocking(false);
        (hello, self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// An answering side with `token` greets one connection from a side
    /// with `theirs`; returns (the answering side's verdict, the
    /// connecting side's result).
    fn meet(token: Option<&str>, theirs: Option<&str>) -> (bool, Result<(), Refusal>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let theirs = theirs.map(Token::new);
        let dialer = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let mut hello = [0u8; HELLO_BYTES];
            hello[0] = 7;
            let r = introduce(
                &mut s,
                &hello,
                theirs.as_ref(),
                Instant::now() + Duration::from_secs(5),
                None,
            );
            if theirs.is_none() && r.is_ok() {
                // Without a token nothing follows the hello; an answer (or
                // a hang-up) tells what the other side made of it.
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let mut b = [0u8; 1];
                return match s.read(&mut b) {
                    Ok(1) => describe_status(b[0])
                        .map_or(Ok(()), |why| Err(Refusal::Auth(why.to_string()))),
                    Ok(_) => Ok(()),
                    Err(e) => Err(Refusal::Io(e)),
                };
            }
            r
        });
        let (stream, _) = listener.accept().unwrap();
        let token = token.map(Token::new);
        let mut g = Greeting::new(stream).unwrap();
        let start = Instant::now();
        let ready = loop {
            match g.advance(token.as_ref()) {
                Greeted::Pending => {
                    assert!(
                        start.elapsed() < Duration::from_secs(3),
                        "the greeting stalled"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                Greeted::Ready => break true,
                Greeted::Dropped => break false,
            }
        };
        if ready {
            // Let a token-less dialer's read see the end.
            drop(g.finish());
        }
        (ready, dialer.join().unwrap())
    }

    #[test]
    fn each_pairing_of_tokens_ends_at_once_and_says_why() {
        let (ok, r) = meet(Some("k"), Some("k"));
        assert!(ok && r.is_ok());
        let (ok, r) = meet(None, None);
        assert!(ok && r.is_ok());
        let (ok, r) = meet(Some("k"), Some("other"));
        assert!(!ok);
        assert!(matches!(r, Err(Refusal::Auth(m)) if m.contains("does not know")));
        let (ok, r) = meet(Some("k"), None);
        assert!(!ok);
        assert!(matches!(r, Err(Refusal::Auth(m)) if m.contains("requires an auth token")));
        let (ok, r) = meet(None, Some("k"));
        assert!(!ok);
        assert!(matches!(r, Err(Refusal::Auth(m)) if m.contains("has no auth token")));
    }
}

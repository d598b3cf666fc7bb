//! Proving knowledge of the job's shared secret (`auth_token`) without
//! sending it: HMAC-SHA256 over fresh nonces from both sides, each proof
//! labelled with the side and what the connection is for, so no proof can
//! be replayed on another connection or reflected back to its sender.
//!
//! Every exchange has three messages: the connecting side sends its nonce,
//! the answering side its nonce and its proof, the connecting side its
//! proof. The answering side proves first, so a client shows nothing to a
//! stranger that does not know the token. Proofs are not bound to the
//! connection (there is no TLS): someone on the network path could relay
//! a handshake between two real parties, though never learn the token.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof.
pub const NONCE_BYTES: usize = 32;
pub const PROOF_BYTES: usize = 32;

/// The shared secret. Never printed (Debug hides it).
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Which side a proof comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Answering,
    Connecting,
}

impl Token {
    pub fn new(secret: &str) -> Token {
        Token(secret.as_bytes().to_vec())
    }

    /// The proof of `side` for a connection about `context` (the protocol
    /// and whatever both sides agreed on before, e.g. the hello), over the
    /// connecting side's nonce and the answering side's.
    pub fn prove(
        &self,
        side: Side,
        context: &[u8],
        connecting_nonce: &[u8],
        answering_nonce: &[u8],
    ) -> [u8; PROOF_BYTES] {
        self.mac(side, context, connecting_nonce, answering_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is `side`'s proof (compared in constant time).
    pub fn verify(
        &self,
        side: Side,
        context: &[u8],
        connecting_nonce: &[u8],
        answering_nonce: &[u8],
        proof: &[u8],
    ) -> bool {
        self.mac(side, context, connecting_nonce, answering_nonce)
            .verify_slice(proof)
            .is_ok()
    }

    fn mac(&self, side: Side, context: &[u8], connecting: &[u8], answering: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        let label: &[u8] = match side {
            Side::Answering => b"rdist-auth-1 answering",
            Side::Connecting => b"rdist-auth-1 connecting",
        };
        for part in [label, context, connecting, answering] {
            // Length-prefixed, so no two different inputs read the same.
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    crate::random::fill(&mut n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // RFC 4231 test case 2 (key "Jefe"), through the raw HMAC.
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn proofs_bind_the_token_the_side_the_context_and_both_nonces() {
        let token = Token::new("s3cret");
        let (c, a) = (nonce(), nonce());
        assert_ne!(c, a);
        let proof = token.prove(Side::Connecting, b"hello", &c, &a);
        assert!(token.verify(Side::Connecting, b"hello", &c, &a, &proof));
        assert!(!Token::new("s3cret!").verify(Side::Connecting, b"hello", &c, &a, &proof));
        assert!(!token.verify(Side::Answering, b"hello", &c, &a, &proof));
        assert!(!token.verify(Side::Connecting, b"hellO", &c, &a, &proof));
        assert!(!token.verify(Side::Connecting, b"hello", &a, &c, &proof));
        assert!(!token.verify(Side::Connecting, b"hello", &c, &a, &proof[..31]));
        assert_eq!(format!("{token:?}"), "Token(..)");
    }
}

//! Peer authentication: mutual challenge-response over a shared secret (HMAC-SHA256), so the
//! secret never crosses the wire and a peer that does not hold it cannot write a byte.
//!
//! ```text
//! receiver -> sender   "TKV1" | version u16 | receiver nonce (32 bytes)
//! sender   -> receiver "TKV1" | version u16 | sender nonce (32) | HMAC(secret, "tandem-kv/1 sender" | rn | sn)
//! receiver -> sender   status u8 (0 ok, 1 refused) | HMAC(secret, "tandem-kv/1 receiver" | sn | rn)
//! ```
//!
//! Both sides check the other's MAC in constant time. The receiver reads no frame before the
//! sender's MAC checks out and closes the connection when it does not.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::wire::{HELLO_MAGIC, VERSION};
use crate::TransferError;

const NONCE: usize = 32;
const MAC: usize = 32;

/// The cluster's shared KV secret (`--kv-secret` / `TANDEM_KV_SECRET`).
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Shortest secret accepted, in bytes.
pub const MIN_SECRET: usize = 16;

impl Secret {
    /// A secret of `bytes`; refused when shorter than [`MIN_SECRET`].
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, TransferError> {
        let b = bytes.into();
        if b.len() < MIN_SECRET {
            return Err(TransferError::Config(format!(
                "the KV secret must be at least {MIN_SECRET} bytes, got {}",
                b.len()
            )));
        }
        Ok(Self(b))
    }

    /// A fresh random secret (for a cluster started on one machine).
    pub fn random() -> Self {
        let mut b = vec![0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut b);
        Self(
            b.iter()
                .map(|x| format!("{x:02x}"))
                .collect::<String>()
                .into_bytes(),
        )
    }

    /// The secret as text (for passing to a child process).
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    fn mac(&self, label: &[u8], a: &[u8], b: &[u8]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.update(a);
        m.update(b);
        m
    }
}

const SENDER_LABEL: &[u8] = b"tandem-kv/1 sender";
const RECEIVER_LABEL: &[u8] = b"tandem-kv/1 receiver";

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

async fn read_hello<S: AsyncRead + Unpin>(s: &mut S) -> Result<[u8; NONCE], TransferError> {
    let mut head = [0u8; 6];
    s.read_exact(&mut head).await?;
    if head[0..4] != HELLO_MAGIC {
        return Err(TransferError::Handshake(
            "peer does not speak the Tandem KV protocol".into(),
        ));
    }
    let v = u16::from_le_bytes([head[4], head[5]]);
    if v != VERSION {
        return Err(TransferError::Handshake(format!(
            "peer speaks KV protocol version {v}, this side {VERSION}"
        )));
    }
    let mut n = [0u8; NONCE];
    s.read_exact(&mut n).await?;
    Ok(n)
}

fn hello(n: &[u8; NONCE]) -> Vec<u8> {
    let mut b = Vec::with_capacity(6 + NONCE);
    b.extend_from_slice(&HELLO_MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(n);
    b
}

/// The receiver's half. Errors mean the peer is refused (the caller closes the connection).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
) -> Result<(), TransferError> {
    let rn = nonce();
    s.write_all(&hello(&rn)).await?;
    s.flush().await?;
    let sn = read_hello(s).await?;
    let mut mac = [0u8; MAC];
    s.read_exact(&mut mac).await?;
    if secret
        .mac(SENDER_LABEL, &rn, &sn)
        .verify_slice(&mac)
        .is_err()
    {
        let _ = s.write_all(&[1u8; 1 + MAC]).await;
        return Err(TransferError::Unauthenticated);
    }
    let mut reply = vec![0u8];
    reply.extend_from_slice(&secret.mac(RECEIVER_LABEL, &sn, &rn).finalize().into_bytes());
    s.write_all(&reply).await?;
    s.flush().await?;
    Ok(())
}

/// The sender's half: proves it holds the secret and checks that the receiver does too.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
) -> Result<(), TransferError> {
    let rn = read_hello(s).await?;
    let sn = nonce();
    let mut msg = hello(&sn);
    msg.extend_from_slice(&secret.mac(SENDER_LABEL, &rn, &sn).finalize().into_bytes());
    s.write_all(&msg).await?;
    s.flush().await?;
    let mut reply = [0u8; 1 + MAC];
    s.read_exact(&mut reply).await?;
    if reply[0] != 0 {
        return Err(TransferError::Unauthenticated);
    }
    secret
        .mac(RECEIVER_LABEL, &sn, &rn)
        .verify_slice(&reply[1..])
        .map_err(|_| TransferError::Handshake("the receiver does not hold the KV secret".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn same_secret_passes_both_ways_and_a_wrong_one_is_refused() {
        let s = Secret::new("0123456789abcdef-cluster").unwrap();
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (r, c) = tokio::join!(accept(&mut a, &s), connect(&mut b, &s));
        r.unwrap();
        c.unwrap();

        let wrong = Secret::new("fedcba9876543210-intruder").unwrap();
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (r, c) = tokio::join!(accept(&mut a, &s), connect(&mut b, &wrong));
        assert!(matches!(r, Err(TransferError::Unauthenticated)));
        assert!(matches!(c, Err(TransferError::Unauthenticated)));
    }

    #[test]
    fn short_secrets_are_refused() {
        assert!(Secret::new("short").is_err());
        assert!(Secret::random().to_text().len() >= MIN_SECRET);
    }
}

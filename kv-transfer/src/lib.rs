//! tandem-kv-transfer: moving KV-cache blocks between workers. Will own the versioned wire format
//! (frames with transfer id, layer, destination block, length and xxh3 checksum), the `KvTransport`
//! trait with TCP (everywhere) and NCCL (between GPUs) implementations, peer authentication by
//! challenge-response over a shared secret, and transfer deadlines. Does not own the KV pool itself
//! (tandem-engine) or the prefill/decode handshake (the workers).

//! tandem-prefill-worker: the gRPC `Prefill` service around an engine in prefill mode. It will batch
//! and chunk prompts, keep its own prefix cache, push exactly the requested KV blocks to the decode
//! worker over tandem-kv-transfer as each chunk's layers finish, and answer with the first token.

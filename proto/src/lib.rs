//! tandem-proto: the wire contracts of Tandem, as `.proto` files and the tonic/prost code generated
//! from them: the public API (`tandem.v1.Generation`: Generate stream, Tokenize, ListModels) and the
//! worker API (`Decode`, `Prefill`, KV events). Nothing here yet: the cluster issue fills it.

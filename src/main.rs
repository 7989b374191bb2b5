//! `tandem`: one binary, a subcommand per role. Its code is the `tandem-cli` crate (`cli/`): this
//! package holds only this call and the end-to-end tests (tests/e2e), which then build without
//! the optimizer (see the workspace's `Cargo.toml`).

fn main() {
    tandem_cli::main()
}

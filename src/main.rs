fn main() {
    println!("orca-relay {}", env!("CARGO_PKG_VERSION"));
}

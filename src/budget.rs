//! The connection budget tool (SPEC §10). TEMPORARY stub.
pub fn run_file(_path: &std::path::Path) -> Result<String, String> {
    Err("not available yet".into())
}

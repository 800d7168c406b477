//! AFL target: the request head parser both listeners share (`http::head::parse_head`), the
//! request target's form (`http::head::split_target`) and the WebSocket upgrade's validation
//! (`relay::upgrade::check`).
//!
//! Every prefix of the input (the bytes as they arrive, up to the 8 KiB head bound) parses
//! without panic; once the head is complete its end never moves, an origin-form target keeps
//! its path whatever its query holds, and the upgrade check decides without panic.

use orca_relay::http::head::{parse_head, split_target, MAX_HEAD_BYTES};
use orca_relay::relay::upgrade::check;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let data = &data[..data.len().min(MAX_HEAD_BYTES)];
        let mut head_end = None;
        for end in 0..=data.len() {
            match parse_head(&data[..end]) {
                Ok(Some((head, len))) => {
                    assert_eq!(*head_end.get_or_insert(len), len, "the head's end moved");
                    if let Some((path, _)) = split_target(&head.target) {
                        assert!(path.starts_with('/'));
                        if head.target.starts_with('/') {
                            assert!(head.target.starts_with(path), "an origin form rerouted");
                        }
                    }
                    let _ = check(&head);
                }
                Ok(None) => assert!(head_end.is_none(), "complete, then partial"),
                Err(_) => break,
            }
        }
    });
}

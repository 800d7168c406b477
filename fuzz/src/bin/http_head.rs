//! AFL target: the WebSocket listener's request head parser (`relay::upgrade::parse_head`;
//! point it at the shared head reader of `http.rs` once that exists).
//!
//! Every prefix of the input (the bytes as they arrive, up to the 8 KiB head bound) parses
//! without panic; once the head is complete its end never moves and the rest is the tail.

use orca_relay::http::head::MAX_HEAD_BYTES;
use orca_relay::relay::upgrade::{parse_head, route};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let data = &data[..data.len().min(MAX_HEAD_BYTES)];
        let mut head_end = None;
        for end in 0..=data.len() {
            match parse_head(&data[..end]) {
                Ok(Some(request)) => {
                    let at = end - request.tail.len();
                    assert_eq!(*head_end.get_or_insert(at), at, "the head's end moved");
                    let _ = route(&request.path);
                }
                Ok(None) => assert!(head_end.is_none(), "complete, then partial"),
                Err(_) => break,
            }
        }
    });
}

//! AFL target: the splice legs' frame parser (`relay::frames::FrameParser`).
//!
//! The first input byte picks the read size (1–256 bytes per read), the rest is the stream. The
//! same stream is parsed whole and in reads of that size: both must give the same frames and
//! the same end; the parser must never ask for more than one frame's bound.

use orca_relay::relay::frames::{FrameParser, Parsed, MAX_HEADER_BYTES};

const LIMIT: usize = 4096;

/// (frames as (kind, fin, payload), violation) for `stream` read `step` bytes at a time.
fn parse(stream: &[u8], step: usize) -> (Vec<String>, Option<String>) {
    let mut parser = FrameParser::new(LIMIT);
    let mut buffer = Vec::new();
    let mut frames = Vec::new();
    for chunk in stream.chunks(step.max(1)) {
        buffer.extend_from_slice(chunk);
        loop {
            match parser.parse(&mut buffer) {
                Parsed::Incomplete { needed } => {
                    assert!(needed > buffer.len() && needed <= LIMIT + MAX_HEADER_BYTES);
                    break;
                }
                Parsed::Frame(frame) => {
                    frames.push(format!(
                        "{:?} {} {:?}",
                        frame.kind,
                        frame.fin,
                        &buffer[frame.payload()]
                    ));
                    buffer.drain(..frame.wire_len());
                }
                Parsed::Violation(violation) => return (frames, Some(format!("{violation:?}"))),
            }
        }
    }
    (frames, None)
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some((&step, stream)) = data.split_first() else {
            return;
        };
        let whole = parse(stream, stream.len());
        let split = parse(stream, usize::from(step) + 1);
        assert_eq!(whole, split, "the read split changed the result");
    });
}

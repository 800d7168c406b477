//! The crash store's records: what a restarted process needs to resume one connection after
//! this one died without a word (`kill -9`, an OOM kill, a watchdog kill, a panic in a thread it
//! cannot live without), written down in a fixed-size slot of a shared memory segment that
//! outlives the process (`crash_store/`).
//!
//! A slot is [`SLOT_BYTES`] long: an 8-byte sequence number, a 4-byte word of I/O flags, then the
//! record. The record is written as a seqlock: the sequence number is made odd, the bytes are
//! written, the sequence number is made even again, so a record a crash tore in the middle (an
//! odd number, or bytes that do not decode) is recognised and never resumed. The I/O flags are
//! set and cleared around every read and write of the connection's socket, with no syscall:
//! [`IO_READING`] from just before a read until every byte it brought is acted on (forwarded, or
//! held in the record as [`CrashRecord::partial`]), [`IO_WRITING`] while a frame is on its way
//! out (a crash then leaves half a frame on the wire), [`IO_HOLDING`] while the process holds
//! bytes of the connection's that are in no record (output queued for a slow reader, a frame
//! being streamed, a phone waiting for its data leg). A connection whose flags are not all
//! clear when the process dies cannot be resumed exactly: it is closed with 1012.
//!
//! Plain data: the relay builds a [`CrashRecord`] from a live connection; the restarted process
//! rebuilds a connection from one (`roles/resume.rs`).

use super::connection::{AdmitPathRecord, ClaimsRecord, ControlRecord, ParserRecord};

/// The bytes of one slot, the sequence number and flags included.
pub const SLOT_BYTES: usize = 512;
/// Where the record starts in a slot.
pub const RECORD_OFFSET: usize = 16;
/// The most a record may take.
pub const RECORD_BYTES: usize = SLOT_BYTES - RECORD_OFFSET;
/// The bytes of a control's partial frame a record can hold (more: the control is not
/// resumable while they wait).
pub const PARTIAL_BYTES: usize = 160;
/// The region's first bytes: what it is and how it is laid out.
pub const HEADER_BYTES: usize = 64;
/// The region's magic: what it is, and the layout's version.
pub const MAGIC: &[u8; 8] = b"ORCACRS1";

/// A read is under way, or bytes it brought are not acted on yet.
pub const IO_READING: u32 = 1;
/// A frame is being written.
pub const IO_WRITING: u32 = 2;
/// The process holds bytes of this connection that no record has.
pub const IO_HOLDING: u32 = 4;

/// What kind of connection a slot describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashKind {
    /// A seated desktop control.
    Control,
    /// A phone's leg of a spliced pair.
    Phone,
    /// A desktop's data leg of a spliced pair.
    Data,
}

impl CrashKind {
    fn code(self) -> u8 {
        match self {
            CrashKind::Control => 1,
            CrashKind::Phone => 2,
            CrashKind::Data => 3,
        }
    }

    fn from_code(code: u8) -> Option<CrashKind> {
        match code {
            1 => Some(CrashKind::Control),
            2 => Some(CrashKind::Phone),
            3 => Some(CrashKind::Data),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CrashKind::Control => "control",
            CrashKind::Phone => "phone",
            CrashKind::Data => "data",
        }
    }
}

/// One connection as the crash store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashRecord {
    pub kind: CrashKind,
    /// The connection id (its name in the descriptor store is `c<id>`).
    pub id: u64,
    /// The socket's inode (`fstat`): the restarted process checks that the descriptor stored
    /// under the name is the socket the record describes.
    pub inode: u64,
    /// The parser's fragmentation state (the frames this connection sends).
    pub parser: ParserRecord,
    /// A control: who it is and how it was admitted.
    pub control: Option<ControlRecord>,
    /// A spliced leg: the desktop it belongs to.
    pub relay_host_id: Option<String>,
    /// A spliced leg: its peer's connection id, once spliced.
    pub peer: Option<u64>,
    /// A control's bytes read past the last whole frame (at most [`PARTIAL_BYTES`]).
    pub partial: Vec<u8>,
}

/// Why a record cannot be written down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodeError {
    /// A field is longer than a slot holds (a user id of hundreds of bytes, a long partial
    /// frame): the connection is kept in no record and closed 1012 after a crash.
    TooLarge,
}

struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn bytes(&mut self, bytes: &[u8]) -> Result<(), EncodeError> {
        let end = self.at + bytes.len();
        if end > self.out.len() {
            return Err(EncodeError::TooLarge);
        }
        self.out[self.at..end].copy_from_slice(bytes);
        self.at = end;
        Ok(())
    }

    fn u8(&mut self, value: u8) -> Result<(), EncodeError> {
        self.bytes(&[value])
    }

    fn u64(&mut self, value: u64) -> Result<(), EncodeError> {
        self.bytes(&value.to_le_bytes())
    }

    /// A string of at most 255 bytes, its length first.
    fn text(&mut self, text: &str) -> Result<(), EncodeError> {
        let len = u8::try_from(text.len()).map_err(|_| EncodeError::TooLarge)?;
        self.u8(len)?;
        self.bytes(text.as_bytes())
    }

    fn optional_text(&mut self, text: Option<&str>) -> Result<(), EncodeError> {
        match text {
            Some(text) => {
                self.u8(1)?;
                self.text(text)
            }
            None => self.u8(0),
        }
    }
}

struct Reader<'a> {
    input: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn bytes(&mut self, len: usize) -> Option<&[u8]> {
        let end = self.at.checked_add(len)?;
        let bytes = self.input.get(self.at..end)?;
        self.at = end;
        Some(bytes)
    }

    fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }

    fn u64(&mut self) -> Option<u64> {
        let bytes = self.bytes(8)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    }

    fn text(&mut self) -> Option<String> {
        let len = self.u8()? as usize;
        String::from_utf8(self.bytes(len)?.to_vec()).ok()
    }

    fn optional_text(&mut self) -> Option<Option<String>> {
        match self.u8()? {
            0 => Some(None),
            1 => self.text().map(Some),
            _ => None,
        }
    }
}

fn admit_code(path: AdmitPathRecord) -> u8 {
    match path {
        AdmitPathRecord::Booking => 1,
        AdmitPathRecord::Memory => 2,
        AdmitPathRecord::Database => 3,
    }
}

fn admit_from(code: u8) -> Option<AdmitPathRecord> {
    match code {
        1 => Some(AdmitPathRecord::Booking),
        2 => Some(AdmitPathRecord::Memory),
        3 => Some(AdmitPathRecord::Database),
        _ => None,
    }
}

/// Writes `record` into `out` (a slot's record bytes, [`RECORD_BYTES`] long).
pub fn encode(record: &CrashRecord, out: &mut [u8]) -> Result<(), EncodeError> {
    if record.partial.len() > PARTIAL_BYTES {
        return Err(EncodeError::TooLarge);
    }
    let mut w = Writer { out, at: 0 };
    w.u8(record.kind.code())?;
    w.u64(record.id)?;
    w.u64(record.inode)?;
    w.u8(record.parser.open_opcode.unwrap_or(0))?;
    w.u64(record.parser.open_len as u64)?;
    match &record.control {
        Some(control) => {
            w.u8(1)?;
            w.text(&control.claims.user_id)?;
            w.text(&control.claims.relay_host_id)?;
            w.u64(control.claims.expires_at)?;
            w.u64(control.epoch as u64)?;
            w.u64(control.generation)?;
            w.u8(admit_code(control.admitted_via))?;
            w.optional_text(control.lease_id.as_deref())?;
        }
        None => w.u8(0)?,
    }
    w.optional_text(record.relay_host_id.as_deref())?;
    match record.peer {
        Some(peer) => {
            w.u8(1)?;
            w.u64(peer)?;
        }
        None => w.u8(0)?,
    }
    w.u8(record.partial.len() as u8)?;
    w.bytes(&record.partial)?;
    Ok(())
}

/// Reads a record written by [`encode`]; `None` when the bytes are not one (a slot torn or
/// never written).
pub fn decode(input: &[u8]) -> Option<CrashRecord> {
    let mut r = Reader { input, at: 0 };
    let kind = CrashKind::from_code(r.u8()?)?;
    let id = r.u64()?;
    let inode = r.u64()?;
    let open_opcode = match r.u8()? {
        0 => None,
        code @ (1 | 2) => Some(code),
        _ => return None,
    };
    let open_len = usize::try_from(r.u64()?).ok()?;
    let control = match r.u8()? {
        0 => None,
        1 => Some(ControlRecord {
            claims: ClaimsRecord {
                user_id: r.text()?,
                relay_host_id: r.text()?,
                expires_at: r.u64()?,
            },
            epoch: r.u64()? as i64,
            generation: r.u64()?,
            admitted_via: admit_from(r.u8()?)?,
            lease_id: r.optional_text()?,
        }),
        _ => return None,
    };
    let relay_host_id = r.optional_text()?;
    let peer = match r.u8()? {
        0 => None,
        1 => Some(r.u64()?),
        _ => return None,
    };
    let partial_len = r.u8()? as usize;
    if partial_len > PARTIAL_BYTES {
        return None;
    }
    let partial = r.bytes(partial_len)?.to_vec();
    Some(CrashRecord {
        kind,
        id,
        inode,
        parser: ParserRecord {
            open_opcode,
            open_len,
        },
        control,
        relay_host_id,
        peer,
        partial,
    })
}

/// The region's header: [`MAGIC`], the slot size and the number of slots.
pub fn encode_header(slots: u32, out: &mut [u8]) {
    out[..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&(SLOT_BYTES as u32).to_le_bytes());
    out[12..16].copy_from_slice(&slots.to_le_bytes());
}

/// The number of slots of a region whose header is `header`; `None` when it is not a region
/// this build reads (another layout, another slot size).
pub fn decode_header(header: &[u8]) -> Option<u32> {
    if header.len() < 16 || &header[..8] != MAGIC {
        return None;
    }
    let slot_bytes = u32::from_le_bytes(header[8..12].try_into().ok()?);
    if slot_bytes as usize != SLOT_BYTES {
        return None;
    }
    Some(u32::from_le_bytes(header[12..16].try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control() -> CrashRecord {
        CrashRecord {
            kind: CrashKind::Control,
            id: 42,
            inode: 991_234,
            parser: ParserRecord {
                open_opcode: Some(1),
                open_len: 17,
            },
            control: Some(ControlRecord {
                claims: ClaimsRecord {
                    user_id: "user-7".into(),
                    relay_host_id: "h7Qx0aB-r2Lk9sTz".into(),
                    expires_at: 1_900_000_000,
                },
                epoch: 12,
                generation: 3,
                admitted_via: AdmitPathRecord::Database,
                lease_id: Some("control:c1:99:42".into()),
            }),
            relay_host_id: None,
            peer: None,
            partial: vec![0x81, 0x85, 1, 2],
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let leg = CrashRecord {
            kind: CrashKind::Phone,
            id: 7,
            inode: 5,
            parser: ParserRecord::default(),
            control: None,
            relay_host_id: Some("h7Qx0aB-r2Lk9sTz".into()),
            peer: Some(8),
            partial: Vec::new(),
        };
        for record in [control(), leg] {
            let mut out = [0u8; RECORD_BYTES];
            encode(&record, &mut out).unwrap();
            assert_eq!(decode(&out), Some(record));
        }
    }

    #[test]
    fn what_does_not_fit_a_slot_is_refused() {
        let mut long = control();
        long.control.as_mut().unwrap().claims.user_id = "u".repeat(300);
        let mut out = [0u8; RECORD_BYTES];
        assert_eq!(encode(&long, &mut out), Err(EncodeError::TooLarge));
        let mut partial = control();
        partial.partial = vec![0; PARTIAL_BYTES + 1];
        assert_eq!(encode(&partial, &mut out), Err(EncodeError::TooLarge));
    }

    #[test]
    fn garbage_and_empty_slots_are_not_records() {
        assert_eq!(decode(&[0u8; RECORD_BYTES]), None);
        assert_eq!(decode(&[9u8; RECORD_BYTES]), None);
        let mut out = [0u8; RECORD_BYTES];
        encode(&control(), &mut out).unwrap();
        // A record cut short (a torn write that left zeros) does not decode.
        for cut in [1, 10, 30] {
            let mut torn = out;
            torn[cut..].fill(0xff);
            assert_ne!(decode(&torn), Some(control()), "cut at {cut}");
        }
    }

    #[test]
    fn headers_name_the_layout() {
        let mut header = [0u8; HEADER_BYTES];
        encode_header(1024, &mut header);
        assert_eq!(decode_header(&header), Some(1024));
        header[0] = b'X';
        assert_eq!(decode_header(&header), None);
    }
}

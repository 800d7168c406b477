//! The crash store's shared memory: a `memfd` mapped `MAP_SHARED`, a header and one fixed-size
//! slot per connection (`carry::crash`). The memfd itself is kept in systemd's descriptor store,
//! so its pages outlive the process: what a dead process last wrote is what the restarted one
//! reads, without a syscall per write (memory written to a shared mapping is the memfd's, not
//! the process's; a store that executed is never lost with the process).
//!
//! Never: hands out a reference into the mapping that outlives the region; writes a record
//! except as a seqlock (sequence odd, bytes, sequence even).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::carry::crash::{
    self, CrashRecord, EncodeError, HEADER_BYTES, RECORD_BYTES, RECORD_OFFSET, SLOT_BYTES,
};

/// A mapped crash-store region.
pub struct Region {
    memfd: OwnedFd,
    base: *mut u8,
    len: usize,
    slots: u32,
}

// SAFETY: the mapping is shared memory owned by the region for its whole life; every access goes
// through atomics or through a slot's seqlock, whose writers the store serialises per slot.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

fn region_len(slots: u32) -> usize {
    HEADER_BYTES + slots as usize * SLOT_BYTES
}

impl Region {
    /// A new region of `slots` slots, every one free.
    pub fn create(slots: u32) -> io::Result<Region> {
        let name = c"orca-relay-crash-store";
        // SAFETY: memfd_create with a valid NUL-terminated name.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = region_len(slots);
        // SAFETY: ftruncate on our memfd; the new pages read as zeros (every slot free).
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let region = Region::map(memfd, len, slots)?;
        let mut header = [0u8; HEADER_BYTES];
        crash::encode_header(slots, &mut header);
        // SAFETY: the header is within the mapping and nobody else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), region.base, HEADER_BYTES) };
        Ok(region)
    }

    /// The region a crashed process left (its memfd, from the descriptor store). `Err` when it
    /// is not a region this build reads.
    pub fn adopt(memfd: OwnedFd) -> io::Result<Region> {
        // SAFETY: fstat into a struct we own.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(memfd.as_raw_fd(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let size = stat.st_size as usize;
        if size < HEADER_BYTES {
            return Err(invalid("the crash store is shorter than its header"));
        }
        let mut header = [0u8; HEADER_BYTES];
        // SAFETY: pread into a buffer we own.
        let read = unsafe {
            libc::pread(
                memfd.as_raw_fd(),
                header.as_mut_ptr().cast(),
                HEADER_BYTES,
                0,
            )
        };
        if read != HEADER_BYTES as isize {
            return Err(invalid("the crash store's header is unreadable"));
        }
        let slots = crash::decode_header(&header)
            .ok_or_else(|| invalid("the crash store has a layout this build does not read"))?;
        let len = region_len(slots);
        if size < len {
            return Err(invalid("the crash store is shorter than its slots"));
        }
        Region::map(memfd, len, slots)
    }

    fn map(memfd: OwnedFd, len: usize, slots: u32) -> io::Result<Region> {
        // SAFETY: a shared read-write mapping of `len` bytes of our memfd.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Region {
            memfd,
            base: base.cast(),
            len,
            slots,
        })
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    fn slot(&self, index: u32) -> *mut u8 {
        assert!(index < self.slots, "slot {index} out of {}", self.slots);
        // SAFETY: within the mapping (checked above).
        unsafe { self.base.add(HEADER_BYTES + index as usize * SLOT_BYTES) }
    }

    fn sequence(&self, index: u32) -> &AtomicU64 {
        // SAFETY: the slot's first 8 bytes, 8-aligned (the mapping is page-aligned, the header
        // and slots are multiples of 8), live as long as `self`.
        unsafe { &*(self.slot(index) as *const AtomicU64) }
    }

    /// The slot's I/O flags (`carry::crash::IO_*`).
    pub fn io(&self, index: u32) -> &AtomicU32 {
        // SAFETY: bytes 8..12 of the slot, 4-aligned, live as long as `self`.
        unsafe { &*(self.slot(index).add(8) as *const AtomicU32) }
    }

    /// Writes `record` into slot `index` (the caller serialises writers of one slot). On
    /// `Err` the slot is left free: the connection is in no record.
    pub fn write(&self, index: u32, record: &CrashRecord) -> Result<(), EncodeError> {
        let mut bytes = [0u8; RECORD_BYTES];
        let encoded = crash::encode(record, &mut bytes);
        let sequence = self.sequence(index);
        let odd = sequence.load(Ordering::Relaxed) | 1;
        sequence.store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        if encoded.is_err() {
            bytes = [0u8; RECORD_BYTES];
        }
        // SAFETY: the record's bytes of the slot, within the mapping; one writer at a time.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.slot(index).add(RECORD_OFFSET),
                RECORD_BYTES,
            )
        };
        fence(Ordering::Release);
        sequence.store(odd + 1, Ordering::Release);
        encoded
    }

    /// Frees slot `index`: no record, flags clear.
    pub fn clear(&self, index: u32) {
        let sequence = self.sequence(index);
        let odd = sequence.load(Ordering::Relaxed) | 1;
        sequence.store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        // SAFETY: the slot's record bytes; one writer at a time.
        unsafe { std::ptr::write_bytes(self.slot(index).add(RECORD_OFFSET), 0, RECORD_BYTES) };
        self.io(index).store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        sequence.store(odd + 1, Ordering::Release);
    }

    /// What slot `index` holds, as the process that wrote it left it: `None` for a free slot
    /// or a torn one (its sequence odd, its bytes no record). Only meaningful while nobody
    /// writes the slot (the writer is dead, or it is this process's own).
    pub fn read(&self, index: u32) -> Option<(CrashRecord, u32)> {
        let sequence = self.sequence(index).load(Ordering::Acquire);
        if sequence % 2 == 1 || sequence == 0 {
            return None;
        }
        let mut bytes = [0u8; RECORD_BYTES];
        // SAFETY: the record bytes of the slot, within the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.slot(index).add(RECORD_OFFSET),
                bytes.as_mut_ptr(),
                RECORD_BYTES,
            )
        };
        let record = crash::decode(&bytes)?;
        Some((record, self.io(index).load(Ordering::Acquire)))
    }

    /// Whether slot `index`'s sequence is odd: a write the writer never finished.
    pub fn torn(&self, index: u32) -> bool {
        self.sequence(index).load(Ordering::Acquire) % 2 == 1
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping we made, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn invalid(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::carry::connection::ParserRecord;
    use crate::carry::crash::{CrashKind, IO_READING};

    fn leg(id: u64) -> CrashRecord {
        CrashRecord {
            kind: CrashKind::Data,
            id,
            inode: id * 10,
            parser: ParserRecord::default(),
            control: None,
            relay_host_id: Some("host".into()),
            peer: Some(id + 1),
            partial: Vec::new(),
        }
    }

    #[test]
    fn a_region_adopted_from_its_memfd_reads_what_was_written() {
        let region = Region::create(8).unwrap();
        region.write(3, &leg(3)).unwrap();
        region.io(3).store(IO_READING, Ordering::Release);
        region.write(5, &leg(5)).unwrap();
        region.clear(5);
        // SAFETY: dup of a live descriptor.
        let copy = unsafe { OwnedFd::from_raw_fd(libc::dup(region.memfd().as_raw_fd())) };
        drop(region);
        let adopted = Region::adopt(copy).unwrap();
        assert_eq!(adopted.slots(), 8);
        assert_eq!(adopted.read(3), Some((leg(3), IO_READING)));
        assert_eq!(adopted.read(5), None);
        assert_eq!(adopted.read(0), None);
    }

    #[test]
    fn a_write_torn_by_a_crash_is_no_record() {
        let region = Region::create(2).unwrap();
        region.write(1, &leg(1)).unwrap();
        // What a crash between the odd sequence and the even one leaves.
        let sequence = region.sequence(1);
        sequence.store(sequence.load(Ordering::Relaxed) + 1, Ordering::Release);
        assert!(region.torn(1));
        assert_eq!(region.read(1), None);
    }

    #[test]
    fn a_memfd_that_is_not_a_region_is_refused() {
        let name = c"not-a-region";
        // SAFETY: memfd_create with a valid name; the descriptor is ours.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(name.as_ptr(), 0)) };
        // SAFETY: ftruncate on our memfd.
        unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) };
        assert!(Region::adopt(fd).is_err());
    }
}

//! One single-producer/single-consumer ring of records in a segment: the
//! record format, writing, reading (copied, lent whole or combined in
//! place) and freeing space.

use super::segment::{Segment, CTL_BYTES};
use crate::copy;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

impl Segment {
    pub(super) fn ring(self: &Arc<Self>, slot: usize) -> Ring {
        assert!(
            (slot + 1) * self.slot_bytes() <= self.len,
            "ring slot out of the segment"
        );
        assert!(
            self.ring_bytes.is_power_of_two(),
            "ring size not a power of two"
        );
        // SAFETY: inside the mapping (checked above).
        let ctl = unsafe { self.base.add(slot * self.slot_bytes()) };
        Ring {
            _segment: self.clone(),
            bytes: self.ring_bytes,
            // SAFETY: the tail word sits 64 bytes in, inside the control block.
            tail: unsafe { ctl.add(64) }.cast(),
            // SAFETY: the data area follows the control block.
            data: unsafe { ctl.add(CTL_BYTES) },
            tail_seen: Cell::new(0),
            at: Cell::new(0),
            number: Cell::new(1),
            taken: Cell::new(0),
            payload_lines: std::cell::RefCell::new(Vec::new()),
        }
    }
}

/// One SPSC ring of records. Each record starts on a cache line with an
/// 8-byte word (its number, low half; its length, high half) followed by
/// its bytes, and is published by storing that word last. The reader polls
/// the word where the next record starts, so a small message costs one
/// cache-line transfer (word and bytes share the line) instead of one for
/// an index and another for the data. `tail` (bytes freed by the reader)
/// tells the writer which space it may reuse.
pub(super) struct Ring {
    _segment: Arc<Segment>,
    /// Bytes of the data area (a power of two, at least `RECORD_ALIGN`).
    bytes: usize,
    tail: *const AtomicU64,
    data: *mut u8,
    /// The writer's last reading of `tail` (never ahead of the real one).
    tail_seen: Cell<u64>,
    /// Where this side is: the writer's next record (bytes ever used), or
    /// the reader's current record.
    at: Cell<u64>,
    /// Number of the record at `at` (the first is 1; memory never written
    /// reads as record 0, so it is never taken for one).
    number: Cell<u32>,
    /// Reader: bytes of the current record already handed out.
    taken: Cell<usize>,
    /// Writer: per 64-byte line of the ring, whether it was last written
    /// with payload (1) rather than a record's word (0).
    payload_lines: std::cell::RefCell<Vec<u8>>,
}

/// Records start on cache lines, so a small one shares its line with its word.
const RECORD_ALIGN: u64 = 64;
const RECORD_WORD: usize = 8;
/// Largest record: a stream of records is cut into eighths of what is
/// left, between `STREAM_RECORD` and this (see `write2`).
const MAX_RECORD: usize = 64 << 10;
/// Largest message written whole: 16 KiB and a frame's header, so that a
/// small message sent whole (`stream/small.rs`, `tagged`) fits. A larger
/// one in one record made its reader wait for all of it (a copy in, then a
/// copy out).
const WHOLE_RECORD: usize = WHOLE_PAYLOAD + 56;
/// The largest payload of a message written whole (see `WHOLE_RECORD`).
pub const WHOLE_PAYLOAD: usize = 16 << 10;
/// Smallest record of a stream: whole lines, and no smaller than a message
/// written whole, which would otherwise leave its last bytes to a second.
const STREAM_RECORD: usize = WHOLE_RECORD.next_multiple_of(RECORD_ALIGN as usize);

// SAFETY: see Segment; each Ring is used by one side only.
unsafe impl Send for Ring {}

/// Where the next record starts after one of `len` bytes at `at`.
fn record_end(at: u64, len: usize) -> u64 {
    at + ((RECORD_WORD + len) as u64).next_multiple_of(RECORD_ALIGN)
}

impl Ring {
    /// Where ring position `pos` (bytes ever written) lies in the data
    /// area: the ring's size is a power of two, so a mask (a division
    /// costs tens of cycles, several times per message).
    #[inline]
    fn offset(&self, pos: u64) -> usize {
        (pos & (self.bytes as u64 - 1)) as usize
    }

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: points at an 8-aligned word of the live mapping.
        unsafe { &*self.tail }
    }

    /// The word of the record starting at byte `at` of the ring.
    fn word(&self, at: u64) -> &AtomicU64 {
        // SAFETY: `offset(at)` is a multiple of 64, inside the data
        // area, so the word is aligned and mapped.
        unsafe { &*self.data.add(self.offset(at)).cast::<AtomicU64>() }
    }

    /// Reader: bytes freed for the writer so far.
    pub(super) fn freed(&self) -> u64 {
        self.at.get()
    }

    /// Length of the next unread record, if it has been published.
    fn next_record(&self) -> Option<usize> {
        let w = self.word(self.at.get()).load(Ordering::Acquire);
        (w as u32 == self.number.get()).then_some((w >> 32) as usize)
    }

    pub(super) fn readable(&self) -> usize {
        self.next_record().map_or(0, |len| len - self.taken.get())
    }

    /// Copies `len` bytes starting at ring byte `from` (wrapping) into `to`.
    fn copy_out(&self, from: u64, to: &mut [u8]) {
        let at = self.offset(from);
        let first = to.len().min(self.bytes - at);
        // SAFETY: both ranges lie inside the data area, in a published
        // record that the writer does not touch until `tail` passes it.
        unsafe {
            copy::copy_nonoverlapping(self.data.add(at), to.as_mut_ptr(), first);
            if first < to.len() {
                copy::copy_nonoverlapping(self.data, to.as_mut_ptr().add(first), to.len() - first);
            }
        }
    }

    /// Copies `from` into the ring starting at ring byte `to` (wrapping).
    #[inline]
    fn copy_in(&self, to: u64, from: &[u8]) {
        let at = self.offset(to);
        let first = from.len().min(self.bytes - at);
        // SAFETY: the range lies in space the reader has freed and that no
        // published record covers until the word below is stored.
        unsafe {
            copy::copy_nonoverlapping(from.as_ptr(), self.data.add(at), first);
            if first < from.len() {
                copy::copy_nonoverlapping(from.as_ptr().add(first), self.data, from.len() - first);
            }
        }
    }

    /// Copies up to `buf.len()` bytes out of published records; returns how
    /// many.
    pub(super) fn read(&self, buf: &mut [u8]) -> usize {
        let mut done = 0;
        while done < buf.len() {
            let Some(len) = self.next_record() else { break };
            let at = self.at.get();
            let taken = self.taken.get();
            let n = (len - taken).min(buf.len() - done);
            self.copy_out(at + (RECORD_WORD + taken) as u64, &mut buf[done..done + n]);
            done += n;
            self.consumed(len, n);
        }
        done
    }

    /// Accounts for `n` more bytes handed out of the current record (of
    /// `len` bytes), freeing its space once all of it is out.
    pub(super) fn consumed(&self, len: usize, n: usize) {
        let taken = self.taken.get() + n;
        if taken < len {
            self.taken.set(taken);
            return;
        }
        let next = record_end(self.at.get(), len);
        self.at.set(next);
        self.number.set(self.number.get().wrapping_add(1));
        self.taken.set(0);
        self.tail().store(next, Ordering::Release);
    }

    /// Hands up to `dst.len()` bytes of the current record, in whole
    /// `unit`s and without a copy, to `combine(dst part, ring bytes)`;
    /// returns how many bytes it consumed (0 when none can go that way:
    /// nothing published, or a unit straddles the record's end or the
    /// ring's wrap).
    pub(super) fn combine(
        &self,
        dst: &mut [u8],
        unit: usize,
        combine: &mut dyn FnMut(&mut [u8], &[u8]),
    ) -> usize {
        let mut done = 0;
        while done < dst.len() {
            let Some(len) = self.next_record() else { break };
            let at = self.at.get();
            let taken = self.taken.get();
            let from = self.offset(at + (RECORD_WORD + taken) as u64);
            let contiguous = (len - taken).min(self.bytes - from);
            let n = contiguous.min(dst.len() - done);
            let n = n - n % unit;
            if n == 0 {
                break;
            }
            // SAFETY: inside the data area, in a published record that the
            // writer does not touch until `tail` passes it.
            let src = unsafe { std::slice::from_raw_parts(self.data.add(from), n) };
            combine(&mut dst[done..done + n], src);
            done += n;
            self.consumed(len, n);
        }
        done
    }

    /// The whole next record, lent without a copy: when it is published,
    /// none of it was handed out yet and it does not wrap around the ring.
    /// Release it with `consumed(len, len)`.
    pub(super) fn peek(&self) -> Option<&[u8]> {
        if self.taken.get() != 0 {
            return None;
        }
        let len = self.next_record()?;
        let from = self.offset(self.at.get() + RECORD_WORD as u64);
        if from + len > self.bytes {
            return None;
        }
        // SAFETY: inside the data area, in a published record that the
        // writer does not touch until `tail` passes it.
        Some(unsafe { std::slice::from_raw_parts(self.data.add(from), len) })
    }

    /// Publishes `a` then `b` as one record if all of it fits now; false
    /// (nothing written) otherwise. Up to `WHOLE_RECORD` bytes: more goes
    /// as a stream of records, which the reader empties as they come.
    pub(super) fn write_whole(&self, a: &[u8], b: &[u8]) -> bool {
        let len = a.len() + b.len();
        if len == 0 || len > WHOLE_RECORD {
            return false;
        }
        let need = record_end(0, len) as usize;
        let at = self.at.get();
        if self.bytes - ((at - self.tail_seen.get()) as usize) < need {
            self.tail_seen.set(self.tail().load(Ordering::Acquire));
            if self.bytes - ((at - self.tail_seen.get()) as usize) < need {
                return false;
            }
        }
        self.write_record(a, b, WHOLE_RECORD) == len
    }

    /// Publishes as much of `a` then `b` as fits as one record; returns how
    /// many bytes.
    pub(super) fn write2(&self, a: &[u8], b: &[u8]) -> usize {
        // An eighth of what is left, so the reader copies out of one record
        // while this side fills the next, and the first, which it waits
        // for, is short; large records cost less per byte. Whole lines, so
        // that no element of a payload reduced straight out of the ring
        // straddles two records (`combine` leaves those to a slower path).
        let most = (((a.len() + b.len()) / 8) & !(RECORD_ALIGN as usize - 1))
            .clamp(STREAM_RECORD, MAX_RECORD);
        self.write_record(a, b, most)
    }

    /// Publishes as much of `a` then `b` as fits, up to `most` bytes, as one
    /// record; returns how many bytes.
    fn write_record(&self, a: &[u8], b: &[u8], most: usize) -> usize {
        if a.is_empty() && b.is_empty() {
            return 0;
        }
        let at = self.at.get();
        let want = RECORD_WORD + (a.len() + b.len()).min(most);
        // The reader's tail lives on a line the reader keeps writing: read
        // it (one cache-line transfer) only when the last value seen leaves
        // too little room.
        let mut free = self.bytes - (at - self.tail_seen.get()) as usize;
        if free < want {
            self.tail_seen.set(self.tail().load(Ordering::Acquire));
            free = self.bytes - (at - self.tail_seen.get()) as usize;
        }
        if free < RECORD_ALIGN as usize {
            return 0;
        }
        // `free` is a multiple of the alignment, so the padded record fits.
        let len = (want.min(free) - RECORD_WORD).min(a.len() + b.len());
        let from_a = len.min(a.len());
        let body = at + RECORD_WORD as u64;
        self.copy_in(body, &a[..from_a]);
        self.copy_in(body + from_a as u64, &b[..len - from_a]);
        let number = self.number.get();
        let next = record_end(at, len);
        // Where the next record will start, the ring may still hold bytes of
        // an older record's payload, which could read as that record's
        // number (user data full of small integers does): overwrite them
        // before publishing this record, so a reader that gets here early
        // finds no record. A line that begins with an older record's word
        // needs nothing (that number is from the previous lap, never the
        // next one), so a stream of small records never pays for this; and
        // when the ring is exactly full, the slot is the reader's unread
        // record, which is such a word.
        let mut lines = self.payload_lines.borrow_mut();
        if lines.is_empty() {
            lines.resize(self.bytes / RECORD_ALIGN as usize, 0);
        }
        let line = |pos: u64| self.offset(pos) / RECORD_ALIGN as usize;
        let next_line = line(next);
        if lines[next_line] != 0 {
            if next - self.tail_seen.get() >= self.bytes as u64 {
                self.tail_seen.set(self.tail().load(Ordering::Acquire));
            }
            if next - self.tail_seen.get() < self.bytes as u64 {
                let not_next = !number.wrapping_add(1);
                self.word(next)
                    .store(u64::from(not_next), Ordering::Relaxed);
                lines[next_line] = 0;
            }
        }
        // This record: a word on its first line, payload on the others.
        let (first, end) = (line(at), line(at) + ((next - at) / RECORD_ALIGN) as usize);
        lines[first] = 0;
        if end == first + 1 {
            // One line, word and payload: nothing more to mark.
        } else if end <= lines.len() {
            lines[first + 1..end].fill(1);
        } else {
            let wrap = end - lines.len();
            lines[first + 1..].fill(1);
            lines[..wrap].fill(1);
        }
        drop(lines);
        self.word(at)
            .store(u64::from(number) | (len as u64) << 32, Ordering::Release);
        self.number.set(number.wrapping_add(1));
        self.at.set(next);
        len
    }
}

#[cfg(test)]
mod tests {
    use super::super::segment::{MIN_RING_BYTES, RING_BYTES};
    use super::*;

    /// Two views of one ring in a fresh, already unlinked segment (the
    /// rings keep it mapped): one to write, one to read.
    fn ring_pair(tag: &str) -> (Ring, Ring) {
        ring_pair_of(tag, RING_BYTES)
    }

    fn ring_pair_of(tag: &str, ring_bytes: usize) -> (Ring, Ring) {
        let _ = tag;
        let seg = Arc::new(Segment::create_private(2, ring_bytes).unwrap().0);
        (seg.ring(1), seg.ring(1))
    }

    #[test]
    fn rings_carry_bytes_across_wraparound() {
        // The largest ring, and the smallest (wide hosts).
        for ring_bytes in [RING_BYTES, MIN_RING_BYTES] {
            wraparound(ring_bytes);
        }
    }

    fn wraparound(ring_bytes: usize) {
        let (writer, reader) = ring_pair_of("wrap-", ring_bytes);
        let pattern: Vec<u8> = (0..8 * ring_bytes).map(|i| (i % 251) as u8).collect();
        let (mut sent, mut got) = (0usize, 0usize);
        let mut out = vec![0u8; 200_000];
        // Writes of every size (tiny to several records), reads of every
        // size (a few bytes of a record up to many records at once).
        let (mut w, mut r) = (1usize, 1usize);
        while got < 6 * ring_bytes {
            w = (w * 7 + 3) % 300_000;
            r = (r * 13 + 5) % out.len();
            let rest = &pattern[sent..];
            let end = (w + 1).min(rest.len());
            let split = 7.min(end);
            sent += writer.write2(&rest[..split], &rest[split..end]);
            let m = reader.read(&mut out[..r + 1]);
            assert_eq!(&out[..m], &pattern[got..got + m]);
            got += m;
            assert!(got <= sent);
        }
        // Everything written is read, and an empty ring reads nothing.
        while got < sent {
            let m = reader.read(&mut out);
            assert!(m > 0);
            assert_eq!(&out[..m], &pattern[got..got + m]);
            got += m;
        }
        assert_eq!(reader.read(&mut out), 0);
        assert_eq!(reader.readable(), 0);
    }

    #[test]
    fn stale_payload_bytes_never_pass_for_a_record() {
        let (writer, reader) = ring_pair("stale-");
        // Lap 1: 16 records of 64 KiB fill the ring; every 8-byte word of
        // their payload holds the number a lap-2 record starting there
        // would carry (small records, one per cache line).
        let per = MAX_RECORD - RECORD_WORD;
        let laps_records = (RING_BYTES / MAX_RECORD) as u64;
        let mut out = vec![0u8; MAX_RECORD];
        for k in 0..laps_records {
            let base = k * MAX_RECORD as u64 + RECORD_WORD as u64;
            let payload: Vec<u8> = (0..per / 8)
                .flat_map(|w| {
                    let q = base + 8 * w as u64;
                    (laps_records + 1 + q / RECORD_ALIGN).to_le_bytes()
                })
                .collect();
            assert_eq!(writer.write_record(&payload, &[], MAX_RECORD), per);
            assert_eq!(reader.read(&mut out), per);
            assert_eq!(&out[..per], &payload[..]);
        }
        // Lap 2: one small record; the slot after it held lap-1 payload
        // equal to the next number, and must not read as a record.
        assert_eq!(writer.write2(b"header-and-a-small-payload", &[]), 26);
        assert_eq!(reader.read(&mut out), 26);
        assert_eq!(reader.readable(), 0);
        assert_eq!(reader.read(&mut out), 0);
        assert_eq!(writer.write2(b"next", &[]), 4);
        assert_eq!(reader.read(&mut out), 4);
        assert_eq!(&out[..4], b"next");
    }

    #[test]
    fn whole_records_are_all_or_nothing_and_mix_with_byte_reads() {
        let (writer, reader) = ring_pair("whole-");
        let mut out = vec![0u8; MAX_RECORD];
        // Fill the ring with whole records until one no longer fits: that
        // one writes nothing at all.
        // 1070 bytes: records of 1088 bytes, which do not divide the ring,
        // so some straddle its end.
        let msg: Vec<u8> = (0..1070u32).map(|i| (i % 253) as u8).collect();
        let mut written = 0;
        while writer.write_whole(&msg[..40], &msg[40..]) {
            written += 1;
        }
        let per = record_end(0, msg.len()) as usize;
        assert_eq!(written, RING_BYTES / per);
        assert!(writer.write2(&[], &[]) == 0);
        // Read them back alternately lent whole and copied byte-wise; the
        // reads free room, and a record that would wrap around the ring's
        // end is never lent (it is read byte-wise instead).
        let mut wrapped_seen = false;
        for k in 0..4 * written {
            if k >= written {
                assert!(
                    writer.write_whole(&msg[..40], &msg[40..]),
                    "room after reads"
                );
            }
            let at = (reader.at.get() % RING_BYTES as u64) as usize;
            let wraps = at + RECORD_WORD + msg.len() > RING_BYTES;
            match reader.peek() {
                Some(rec) if k % 2 == 0 => {
                    assert!(!wraps);
                    assert_eq!(rec, &msg[..]);
                    reader.consumed(rec.len(), rec.len());
                }
                lent => {
                    assert!(lent.is_some() != wraps);
                    wrapped_seen |= wraps;
                    // Part of the record, then the rest: nothing is lent
                    // while the record is half read.
                    assert_eq!(reader.read(&mut out[..10]), 10);
                    assert!(reader.peek().is_none());
                    assert_eq!(reader.read(&mut out[10..msg.len()]), msg.len() - 10);
                    assert_eq!(&out[..msg.len()], &msg[..]);
                }
            }
        }
        assert!(wrapped_seen, "some record straddled the ring's end");
        assert!(reader.peek().is_none(), "an empty ring lends nothing");
        assert!(!writer.write_whole(&[], &[]));
        assert!(!writer.write_whole(&vec![0u8; WHOLE_RECORD + 1], &[]));
    }

    #[test]
    fn a_small_message_sent_whole_fits_one_record_and_larger_ones_stream() {
        let (writer, reader) = ring_pair("sizes-");
        let header = [7u8; crate::transport::frame::HEADER_BYTES];
        let payload = vec![1u8; 16 << 10];
        assert!(
            writer.write_whole(&header, &payload),
            "16 KiB and its header go whole"
        );
        assert_eq!(
            reader.peek().map(<[u8]>::len),
            Some(header.len() + payload.len())
        );
        reader.consumed(header.len() + payload.len(), header.len() + payload.len());
        // A message that small streamed is one record too; more goes as
        // records the reader can start on: an eighth of it, from
        // `STREAM_RECORD` to `MAX_RECORD`.
        assert_eq!(
            writer.write2(&header, &payload),
            header.len() + payload.len()
        );
        let big = vec![2u8; 1 << 20];
        assert!(!writer.write_whole(&header, &big[..32 << 10]));
        assert_eq!(writer.write2(&header, &big[..64 << 10]), STREAM_RECORD);
        assert_eq!(writer.write2(&big[..(256 << 10) + 100], &[]), 32 << 10);
        assert_eq!(writer.write2(&big, &[]), MAX_RECORD);
    }
}

//! HPACK decoding (RFC 7541) of a client's header blocks, for the authority rewriter: the
//! client's dynamic table kept as the client's encoder assumes it, each field handed to the
//! caller borrowed.
//!
//! Invariants:
//! - The dynamic table's size (name + value + 32 per entry, RFC 7541 4.1) never exceeds its
//!   maximum, and the maximum never exceeds the limit the server's SETTINGS allow (a size
//!   update above it is an error, 4.2).
//! - A dynamic table size update comes only before the block's first field (4.2; the server's
//!   decoder refuses one after a field).
//! - A field is handed to the caller without copying it: a reference into the table is a
//!   borrow of the entry, a literal a borrow of the block, a Huffman-coded string a borrow of
//!   a buffer reused for the block. So a block of 1-byte references to a 4 KiB entry costs
//!   its caller a count per field, not 4 KiB; the caller stops the block when it has seen
//!   enough ([`Decoder::decode`]). Only an entry added to the table is copied, once, bounded by
//!   the table's size.
//! - Nothing past an error is decoded: the connection is closed on any error, so the table's
//!   state after one does not matter.

use std::collections::VecDeque;

use crate::huffman::{self, HuffmanError};

/// RFC 7541 Appendix A: the static table, index 1 first.
const STATIC_TABLE: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The room for a decoded string a connection keeps between header blocks.
const KEPT_STRING_ROOM: usize = 1024;

/// RFC 7541 4.1: an entry's size counts 32 bytes beside its name and value.
const ENTRY_OVERHEAD: usize = 32;

/// Why a header block does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// An integer runs past the block or beyond `usize`.
    #[error("integer truncated or too large")]
    Integer,
    /// A string is longer than what is left of the block.
    #[error("string longer than the block")]
    StringTruncated,
    /// A Huffman-coded string is malformed.
    #[error(transparent)]
    Huffman(#[from] HuffmanError),
    /// Index 0, or past the static and dynamic tables.
    #[error("index {0} names no table entry")]
    Index(usize),
    /// A table size update above what the server allows.
    #[error("table size update to {size} above the limit {limit}")]
    SizeUpdateTooLarge {
        /// The size asked for.
        size: usize,
        /// The server's limit.
        limit: usize,
    },
    /// A table size update after a field.
    #[error("dynamic table size update after a field")]
    SizeUpdateAfterField,
}

/// Why [`Decoder::decode`] ended a block early.
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError<E> {
    /// The block does not decode.
    Malformed(Malformed),
    /// The caller's callback stopped it.
    Stopped(E),
}

impl<E> From<Malformed> for DecodeError<E> {
    fn from(e: Malformed) -> Self {
        Self::Malformed(e)
    }
}

/// An entry of the dynamic table.
#[derive(Debug)]
struct Entry {
    name: Box<[u8]>,
    value: Box<[u8]>,
}

impl Entry {
    fn size(&self) -> usize {
        self.name.len() + self.value.len() + ENTRY_OVERHEAD
    }
}

/// One connection's HPACK decoding state.
#[derive(Debug)]
pub struct Decoder {
    /// Newest first (index 62 is the front).
    table: VecDeque<Entry>,
    size: usize,
    max_size: usize,
    limit: usize,
    name_buf: Vec<u8>,
    value_buf: Vec<u8>,
}

impl Decoder {
    /// A decoder whose table may grow to `limit` bytes (the server's SETTINGS_HEADER_TABLE_SIZE),
    /// at that size to begin with (RFC 7541 4.2).
    pub fn new(limit: usize) -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max_size: limit,
            limit,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
        }
    }

    /// Decodes `block`, handing each field to `field` in order; stops at the first error, or
    /// when `field` answers `Err` (then [`DecodeError::Stopped`]).
    pub fn decode<E>(
        &mut self,
        block: &[u8],
        field: impl FnMut(&[u8], &[u8]) -> Result<(), E>,
    ) -> Result<(), DecodeError<E>> {
        let result = self.decode_fields(block, field);
        // A connection keeps no more than a small string's room between blocks: thousands of
        // idle connections must not each hold the largest string one block once needed.
        for buf in [&mut self.name_buf, &mut self.value_buf] {
            if buf.capacity() > KEPT_STRING_ROOM {
                *buf = Vec::new();
            }
        }
        result
    }

    fn decode_fields<E>(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]) -> Result<(), E>,
    ) -> Result<(), DecodeError<E>> {
        let mut pos = 0;
        let mut fields = false;
        while let Some(&first) = block.get(pos) {
            match first {
                0x80.. => {
                    let index = integer(block, &mut pos, 7)?;
                    let (name, value) = self.entry(index)?;
                    field(name, value).map_err(DecodeError::Stopped)?;
                }
                0x40..=0x7f => self.literal(block, &mut pos, 6, true, &mut field)?,
                0x20..=0x3f => {
                    if fields {
                        return Err(Malformed::SizeUpdateAfterField.into());
                    }
                    let size = integer(block, &mut pos, 5)?;
                    if size > self.limit {
                        return Err(Malformed::SizeUpdateTooLarge {
                            size,
                            limit: self.limit,
                        }
                        .into());
                    }
                    self.max_size = size;
                    self.evict_to(size);
                    continue;
                }
                // Literal without indexing (0000) or never indexed (0001).
                _ => self.literal(block, &mut pos, 4, false, &mut field)?,
            }
            fields = true;
        }
        Ok(())
    }

    /// A literal field whose first byte has a `prefix`-bit name index; added to the table when
    /// `indexing`.
    fn literal<E>(
        &mut self,
        block: &[u8],
        pos: &mut usize,
        prefix: u32,
        indexing: bool,
        field: &mut impl FnMut(&[u8], &[u8]) -> Result<(), E>,
    ) -> Result<(), DecodeError<E>> {
        let index = integer(block, pos, prefix)?;
        // The name borrows the table or its buffer, the value its own buffer: disjoint fields.
        let name = if index == 0 {
            string(block, pos, &mut self.name_buf)?
        } else {
            entry(&self.table, index)?.0
        };
        let value = string(block, pos, &mut self.value_buf)?;
        field(name, value).map_err(DecodeError::Stopped)?;
        if indexing {
            let entry = Entry {
                name: name.into(),
                value: value.into(),
            };
            self.insert(entry);
        }
        Ok(())
    }

    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), Malformed> {
        entry(&self.table, index)
    }

    /// RFC 7541 4.4: evict from the oldest until the entry fits; an entry larger than the
    /// table empties it and is not added.
    fn insert(&mut self, entry: Entry) {
        let size = entry.size();
        if size > self.max_size {
            self.evict_to(0);
            return;
        }
        self.evict_to(self.max_size - size);
        self.size += size;
        self.table.push_front(entry);
        debug_assert!(self.size <= self.max_size && self.max_size <= self.limit);
    }

    fn evict_to(&mut self, size: usize) {
        while self.size > size {
            let Some(old) = self.table.pop_back() else {
                break;
            };
            self.size -= old.size();
        }
        debug_assert_eq!(self.size, self.table.iter().map(Entry::size).sum::<usize>());
    }
}

/// The field at `index` (RFC 7541 2.3.3: the static table, then the dynamic table newest
/// first).
fn entry(table: &VecDeque<Entry>, index: usize) -> Result<(&[u8], &[u8]), Malformed> {
    match index {
        0 => Err(Malformed::Index(0)),
        1..=61 => {
            let (name, value) = STATIC_TABLE[index - 1];
            Ok((name.as_bytes(), value.as_bytes()))
        }
        _ => table
            .get(index - 62)
            .map(|e| (&e.name[..], &e.value[..]))
            .ok_or(Malformed::Index(index)),
    }
}

/// RFC 7541 5.2: a string at `pos`, a borrow of the block or, Huffman-coded, decoded into `buf`.
fn string<'b>(
    block: &'b [u8],
    pos: &mut usize,
    buf: &'b mut Vec<u8>,
) -> Result<&'b [u8], Malformed> {
    let huffman = block.get(*pos).is_some_and(|b| b & 0x80 != 0);
    let len = integer(block, pos, 7)?;
    let raw = pos
        .checked_add(len)
        .and_then(|end| block.get(*pos..end))
        .ok_or(Malformed::StringTruncated)?;
    *pos += len;
    if !huffman {
        return Ok(raw);
    }
    buf.clear();
    huffman::decode(raw, buf)?;
    Ok(buf)
}

/// RFC 7541 5.1: an integer with a `prefix_bits`-bit prefix at `pos`.
fn integer(block: &[u8], pos: &mut usize, prefix_bits: u32) -> Result<usize, Malformed> {
    let (value, used) = decode_integer(&block[*pos..], prefix_bits).ok_or(Malformed::Integer)?;
    *pos += used;
    Ok(value)
}

/// RFC 7541 5.1: an integer with a `prefix_bits`-bit prefix at the start of `bytes`; (value,
/// bytes used), or None where truncated or beyond `usize`.
pub(crate) fn decode_integer(bytes: &[u8], prefix_bits: u32) -> Option<(usize, usize)> {
    let max = (1_usize << prefix_bits) - 1;
    let mut value = usize::from(*bytes.first()?) & max;
    if value < max {
        return Some((value, 1));
    }
    for (i, &byte) in bytes.iter().enumerate().skip(1) {
        let shift = u32::try_from(7 * (i - 1)).ok()?;
        let part = usize::from(byte & 0x7f).checked_shl(shift)?;
        if shift >= usize::BITS || part >> shift != usize::from(byte & 0x7f) {
            return None;
        }
        value = value.checked_add(part)?;
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

#[cfg(test)]
#[path = "hpack_tests.rs"]
mod tests;

//! The chunked transfer coding (RFC 9112, section 7.1): a strict,
//! incremental decoder, and the pieces to encode.
//!
//! The decoder accepts only what the RFC allows and nothing a lenient
//! parser downstream could read differently: CRLF line ends (a bare LF is
//! an error), 1 to 16 hex digits of size, extensions of visible characters
//! up to [`MAX_LINE`] bytes (read and dropped), and trailer fields up to
//! [`MAX_TRAILERS`] bytes (read and dropped).

/// Longest chunk-size line (size, extensions), bytes.
pub const MAX_LINE: usize = 4096;
/// Longest trailer section, bytes.
pub const MAX_TRAILERS: usize = 16 * 1024;
/// The last chunk with no trailers: the end of a chunked body.
pub const CHUNKED_END: &[u8] = b"0\r\n\r\n";

/// Why a chunked body is malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunked body: {0}")]
pub struct ChunkedError(&'static str);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading hex digits (`digits` so far).
    Size { digits: u8 },
    /// Whitespace after the size, before `;` or the line end.
    SizeSpace,
    /// A chunk extension, up to the line end.
    Extension,
    /// Expecting the LF of the size line.
    SizeLf,
    /// Inside chunk data.
    Data,
    /// Expecting the CR after chunk data.
    DataCr,
    /// Expecting the LF after chunk data.
    DataLf,
    /// At the start of a trailer line (or the final empty line).
    TrailerStart,
    /// In a trailer field's name (a token), before its colon.
    TrailerName,
    /// In a trailer field's value, after the colon.
    TrailerValue,
    /// Expecting the LF of a trailer line.
    TrailerLf,
    /// Expecting the LF of the final empty line.
    EndLf,
    /// The body is complete.
    Done,
}

/// An incremental chunked decoder: feed it bytes as they arrive.
#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: State,
    /// Data bytes left in the current chunk (or its size, while reading it).
    remaining: u64,
    /// Bytes of the current size line.
    line: usize,
    /// Bytes of the trailer section so far.
    trailers: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder { state: State::Size { digits: 0 }, remaining: 0, line: 0, trailers: 0 }
    }
}

/// What one call to [`ChunkedDecoder::decode`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// Input bytes used (framing and data); the caller drops them.
    pub consumed: usize,
    /// Payload bytes, as a range of the input (within `consumed`).
    pub data: Option<std::ops::Range<usize>>,
    /// The body ended (after the last chunk and its trailers).
    pub done: bool,
}

impl ChunkedDecoder {
    /// Whether the whole body has been read.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Reads framing from `input` up to the next payload bytes, and returns
    /// those (at most one run per call). Call again with the unconsumed
    /// rest until it returns nothing new.
    pub fn decode(&mut self, input: &[u8]) -> Result<Decoded, ChunkedError> {
        let mut i = 0;
        while i < input.len() {
            match self.state {
                State::Done => break,
                State::Data => {
                    let n = (input.len() - i).min(usize::try_from(self.remaining).unwrap_or(usize::MAX));
                    self.remaining -= n as u64;
                    if self.remaining == 0 {
                        self.state = State::DataCr;
                    }
                    return Ok(Decoded { consumed: i + n, data: Some(i..i + n), done: false });
                }
                _ => {
                    self.byte(input[i])?;
                    i += 1;
                }
            }
        }
        Ok(Decoded { consumed: i, data: None, done: self.state == State::Done })
    }

    fn byte(&mut self, b: u8) -> Result<(), ChunkedError> {
        use State::*;
        self.state = match self.state {
            Size { digits } => match b {
                b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                    if digits == 16 {
                        return Err(ChunkedError("chunk size over 16 hex digits"));
                    }
                    let v = (b as char).to_digit(16).unwrap_or(0);
                    self.remaining = (self.remaining << 4) | u64::from(v);
                    self.line = 0;
                    Size { digits: digits + 1 }
                }
                _ if digits == 0 => return Err(ChunkedError("chunk size expected")),
                b' ' | b'\t' => SizeSpace,
                b';' => Extension,
                b'\r' => SizeLf,
                _ => return Err(ChunkedError("invalid chunk size")),
            },
            SizeSpace => match b {
                b' ' | b'\t' => SizeSpace,
                b';' => Extension,
                b'\r' => SizeLf,
                _ => return Err(ChunkedError("invalid chunk size line")),
            },
            Extension => match b {
                b'\r' => SizeLf,
                b'\t' | b' '..=b'~' | 0x80..=0xff => {
                    self.line += 1;
                    if self.line > MAX_LINE {
                        return Err(ChunkedError("chunk extension too long"));
                    }
                    Extension
                }
                _ => return Err(ChunkedError("invalid byte in a chunk extension")),
            },
            SizeLf => match b {
                b'\n' if self.remaining == 0 => TrailerStart,
                b'\n' => Data,
                _ => return Err(ChunkedError("chunk size line must end with CRLF")),
            },
            DataCr => match b {
                b'\r' => DataLf,
                _ => return Err(ChunkedError("chunk data must end with CRLF")),
            },
            DataLf => match b {
                b'\n' => Size { digits: 0 },
                _ => return Err(ChunkedError("chunk data must end with CRLF")),
            },
            // A trailer line is a field line (RFC 9112, section 7.1.2):
            // a token, a colon, a value. Anything else (a line without a
            // colon, a folded line, a space before the colon) is refused,
            // as hyper and other servers refuse it: a reading that skips
            // it and one that stops at it could end the body apart.
            TrailerStart => match b {
                b'\r' => EndLf,
                b'\n' => return Err(ChunkedError("bare LF in trailers")),
                _ if is_tchar(b) => self.trailer_byte(TrailerName)?,
                _ => return Err(ChunkedError("invalid trailer field name")),
            },
            TrailerName => match b {
                b':' => self.trailer_byte(TrailerValue)?,
                _ if is_tchar(b) => self.trailer_byte(TrailerName)?,
                _ => return Err(ChunkedError("invalid trailer field name")),
            },
            TrailerValue => match b {
                b'\r' => TrailerLf,
                b'\t' | b' '..=b'~' | 0x80..=0xff => self.trailer_byte(TrailerValue)?,
                _ => return Err(ChunkedError("invalid byte in a trailer")),
            },
            TrailerLf => match b {
                b'\n' => TrailerStart,
                _ => return Err(ChunkedError("trailer line must end with CRLF")),
            },
            EndLf => match b {
                b'\n' => Done,
                _ => return Err(ChunkedError("chunked body must end with CRLF")),
            },
            Data | Done => self.state,
        };
        Ok(())
    }

    fn trailer_byte(&mut self, next: State) -> Result<State, ChunkedError> {
        self.trailers += 1;
        if self.trailers > MAX_TRAILERS {
            return Err(ChunkedError("trailers too large"));
        }
        Ok(next)
    }
}

/// A token character (RFC 9110, section 5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Writes the size line of a chunk of `len` bytes (`{len:x}\r\n`) into
/// `out` and returns it.
pub fn chunk_size_line(len: usize, out: &mut [u8; 18]) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut n = len;
    let mut count = 0;
    loop {
        digits[count] = HEX[n & 0xf];
        count += 1;
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    for (i, d) in digits[..count].iter().rev().enumerate() {
        out[i] = *d;
    }
    out[count] = b'\r';
    out[count + 1] = b'\n';
    &out[..count + 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Decodes `input` fed in pieces of `step` bytes; the payload, or the error.
    fn decode_all(input: &[u8], step: usize) -> Result<(Vec<u8>, usize), ChunkedError> {
        let mut d = ChunkedDecoder::default();
        let mut out = Vec::new();
        let mut pending: Vec<u8> = Vec::new();
        let mut fed = 0;
        let mut used = 0;
        while !d.is_done() {
            if pending.is_empty() || fed < input.len() {
                let end = (fed + step).min(input.len());
                if fed == end && pending.is_empty() {
                    break;
                }
                pending.extend_from_slice(&input[fed..end]);
                fed = end;
            }
            loop {
                let r = d.decode(&pending)?;
                if let Some(range) = r.data.clone() {
                    out.extend_from_slice(&pending[range]);
                }
                pending.drain(..r.consumed);
                used += r.consumed;
                if r.consumed == 0 || r.done || pending.is_empty() {
                    break;
                }
            }
            if fed == input.len() && !d.is_done() && pending.is_empty() {
                break;
            }
        }
        if d.is_done() {
            Ok((out, used))
        } else {
            Err(ChunkedError("incomplete"))
        }
    }

    #[test]
    fn a_body_with_extensions_and_trailers_decodes() {
        let raw = b"5;name=value\r\nhello\r\n6 ; x\r\n world\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";
        let (data, used) = decode_all(raw, 3).unwrap();
        assert_eq!(data, b"hello world");
        assert_eq!(&raw[used..], b"NEXT", "stops exactly at the end of the body");
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        for bad in [
            &b"5\nhello\r\n0\r\n\r\n"[..],
            b"5\r\nhello\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b"0x5\r\nhello\r\n0\r\n\r\n",
            b"-5\r\nhello\r\n0\r\n\r\n",
            b"10000000000000000\r\n",
            b"0\r\n\n",
            b"0\r\nx: 1\n\r\n",
            b"5;a\0b\r\nhello\r\n0\r\n\r\n",
        ] {
            assert!(decode_all(bad, 1).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // 16 hex digits are fine as syntax.
        let mut d = ChunkedDecoder::default();
        assert!(d.decode(b"ffffffffffffffff\r\n").is_ok());
    }

    /// Found by the fuzz campaign (docs/fuzzing.md): trailer lines that
    /// are not field lines were read and dropped; hyper refuses them.
    #[test]
    fn trailer_lines_must_be_fields() {
        for bad in [
            &b"0\r\na\r\n0\r\n\r\n"[..],
            b"0\r\n x: 1\r\n\r\n",
            b"0\r\nx : 1\r\n\r\n",
            b"0\r\n: 1\r\n\r\n",
            b"0\r\nx: 1\r\n\tfolded\r\n\r\n",
            b"0\r\nx: a\x01b\r\n\r\n",
            b"0\r\nx: a\x7fb\r\n\r\n",
        ] {
            assert!(decode_all(bad, 1).is_err(), "{:?}", String::from_utf8_lossy(bad));
            assert!(decode_all(bad, 64).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        for good in [&b"0\r\nx-t: 1\r\n\r\n"[..], b"0\r\nx:\r\ny: a b\t\xe9\r\n\r\n"] {
            assert_eq!(decode_all(good, 1).map(|(d, n)| (d.len(), n)), Ok((0, good.len())));
        }
    }

    #[test]
    fn sixteen_digits_are_syntax() {
        let mut d = ChunkedDecoder::default();
        assert!(d.decode(b"ffffffffffffffff\r\n").is_ok());
    }

    #[test]
    fn size_lines_encode_in_hex() {
        let mut b = [0u8; 18];
        assert_eq!(chunk_size_line(0, &mut b), b"0\r\n");
        assert_eq!(chunk_size_line(255, &mut b), b"ff\r\n");
        assert_eq!(chunk_size_line(usize::MAX, &mut b).len(), 18);
    }

    proptest! {
        #[test]
        fn encoded_chunks_decode_to_the_same_bytes(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..300), 0..8),
            step in 1usize..64,
        ) {
            let mut raw = Vec::new();
            let mut b = [0u8; 18];
            for c in &chunks {
                raw.extend_from_slice(chunk_size_line(c.len(), &mut b));
                raw.extend_from_slice(c);
                raw.extend_from_slice(b"\r\n");
            }
            raw.extend_from_slice(CHUNKED_END);
            let (data, used) = decode_all(&raw, step).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert_eq!(used, raw.len());
        }

        #[test]
        fn arbitrary_input_never_panics(input in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_all(&input, 7);
        }
    }
}

//! Streaming response compression for the `compress` step: a push-based
//! [`Compressor`] both engines drive with the byte chunks they relay.
//!
//! Pure CPU, no IO. The engine creates one per response it compresses
//! (after [`ResponsePlan::compression`](crate::ResponsePlan::compression)
//! chose the coding, and [`compression_head`](crate::response::compression_head)
//! edited the head), [`push`](Compressor::push)es each chunk of the
//! backend's body, [`flush`](Compressor::flush)es when the backend's read
//! would block (so a stream of events or a slow backend is never held back
//! in the encoder, while a body that arrives in a burst is compressed as
//! one: a flush per chunk would cost ratio), and
//! [`finish`](Compressor::finish)es at the body's end. Each call appends
//! the compressed bytes ready to `out`.
//!
//! The encoders are the ones `async-compression` wraps, used directly
//! because both engines need push-based encoding: gzip on `flate2` with
//! its `zlib-rs` backend (pure Rust, zlib-ng's speed), brotli on `brotli`
//! (pure Rust), zstd on `zstd` (the reference C library).
//!
//! Levels ([`Compressor::new`]): gzip 6 (zlib's default, and Traefik's and
//! Caddy's choice; nginx defaults to 1), brotli quality 4 and zstd 3 (the
//! usual choices for compressing on the fly: zstd's own default; brotli's
//! 11 is for files compressed once). The
//! brotli and zstd windows are capped at 512 KiB ([`WINDOW_LOG`], as
//! ngx_brotli's default) to bound the memory each compressed response
//! holds (their defaults, 4 MiB and up to 8 MiB, are for files compressed
//! once); gzip's is deflate's 32 KiB. Measured (resident memory over 100
//! live encoders, text-like bodies of 20 KiB and 1 MiB): gzip about
//! 320 KiB per response, brotli 0.8 to 2.8 MiB, zstd 0.9 to 1.6 MiB.

use std::io;

use brotli::enc::encode::{
    BrotliEncoderDestroyInstance, BrotliEncoderOperation, BrotliEncoderParameter, BrotliEncoderStateStruct,
};
use brotli::enc::StandardAlloc;
use flate2::{Compress, Compression, Crc, FlushCompress};
use tidegate_model::rules::Algorithm;
use zstd::stream::raw::{CParameter, InBuffer, Operation, OutBuffer};

/// gzip's default level (0 to 9).
pub const GZIP_LEVEL: u32 = 6;
/// brotli's default quality (0 to 11).
pub const BROTLI_QUALITY: u32 = 4;
/// zstd's default level (1 to 19 here).
pub const ZSTD_LEVEL: u32 = 3;
/// Base-2 logarithm of the brotli and zstd windows (512 KiB).
pub const WINDOW_LOG: u32 = 19;

/// Output space reserved per encoder call, bytes.
const STEP: usize = 16 * 1024;

/// The gzip header (RFC 1952): deflate, no flags, no time, no extra
/// flags, OS unknown.
const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];

/// Why an encoder refused to go on (none does with a valid level, but
/// the libraries report errors and the proxy does not panic on them: the
/// engine ends the response, whose body cannot be completed).
#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    /// The deflate encoder of gzip.
    #[error("gzip encoder: {0}")]
    Gzip(#[source] flate2::CompressError),
    /// The brotli encoder refused the operation.
    #[error("br encoder: the stream was refused")]
    Brotli,
    /// The zstd encoder.
    #[error("zstd encoder: {0}")]
    Zstd(#[source] io::Error),
}

/// One response's encoder.
pub struct Compressor {
    inner: Inner,
}

enum Inner {
    Gzip { deflate: Box<Compress>, crc: Crc, header: bool },
    Brotli(Box<BrotliEncoderStateStruct<StandardAlloc>>),
    Zstd(zstd::stream::raw::Encoder<'static>),
}

impl std::fmt::Debug for Compressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compressor").field("algorithm", &self.algorithm()).finish_non_exhaustive()
    }
}

impl Drop for Compressor {
    fn drop(&mut self) {
        if let Inner::Brotli(state) = &mut self.inner {
            BrotliEncoderDestroyInstance(state);
        }
    }
}

impl Compressor {
    /// An encoder of `algorithm` at its default level ([`GZIP_LEVEL`],
    /// [`BROTLI_QUALITY`], [`ZSTD_LEVEL`]).
    pub fn new(algorithm: Algorithm) -> Result<Compressor, CompressError> {
        let level = match algorithm {
            Algorithm::Gzip => GZIP_LEVEL,
            Algorithm::Br => BROTLI_QUALITY,
            Algorithm::Zstd => ZSTD_LEVEL,
        };
        Compressor::with_level(algorithm, level)
    }

    /// An encoder of `algorithm` at `level`, brought into the algorithm's
    /// range (gzip 0..=9, brotli 0..=11, zstd 1..=19).
    pub fn with_level(algorithm: Algorithm, level: u32) -> Result<Compressor, CompressError> {
        let inner = match algorithm {
            Algorithm::Gzip => Inner::Gzip {
                deflate: Box::new(Compress::new(Compression::new(level.min(9)), false)),
                crc: Crc::new(),
                header: false,
            },
            Algorithm::Br => {
                let mut state = Box::new(BrotliEncoderStateStruct::new(StandardAlloc::default()));
                let ok = state.set_parameter(BrotliEncoderParameter::BROTLI_PARAM_QUALITY, level.min(11))
                    && state.set_parameter(BrotliEncoderParameter::BROTLI_PARAM_LGWIN, WINDOW_LOG)
                    // Told nothing, the encoder guesses the size from the
                    // first input it has, and at quality 4 a push of 1 MiB
                    // or more makes it pick a much larger hasher (measured:
                    // 6.3 MiB held per encoder, 2.8 MiB with this hint).
                    && state.set_parameter(BrotliEncoderParameter::BROTLI_PARAM_SIZE_HINT, 1 << WINDOW_LOG);
                if !ok {
                    BrotliEncoderDestroyInstance(&mut state);
                    return Err(CompressError::Brotli);
                }
                Inner::Brotli(state)
            }
            Algorithm::Zstd => {
                let level = i32::try_from(level.clamp(1, 19)).unwrap_or(3);
                let mut encoder = zstd::stream::raw::Encoder::new(level).map_err(CompressError::Zstd)?;
                encoder.set_parameter(CParameter::WindowLog(WINDOW_LOG)).map_err(CompressError::Zstd)?;
                Inner::Zstd(encoder)
            }
        };
        Ok(Compressor { inner })
    }

    /// Its algorithm.
    pub fn algorithm(&self) -> Algorithm {
        match self.inner {
            Inner::Gzip { .. } => Algorithm::Gzip,
            Inner::Brotli(_) => Algorithm::Br,
            Inner::Zstd(_) => Algorithm::Zstd,
        }
    }

    /// Compresses `input`, appending to `out` what the encoder has ready
    /// (maybe nothing: it keeps input to compress it better, until
    /// [`flush`](Compressor::flush) or [`finish`](Compressor::finish)).
    pub fn push(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), CompressError> {
        if input.is_empty() {
            return Ok(());
        }
        match &mut self.inner {
            Inner::Gzip { deflate, crc, header } => {
                gzip_header(header, out);
                crc.update(input);
                deflate_run(deflate, input, out, FlushCompress::None)
            }
            Inner::Brotli(state) => brotli_run(state, BrotliEncoderOperation::BROTLI_OPERATION_PROCESS, input, out),
            Inner::Zstd(encoder) => {
                let mut src = InBuffer::around(input);
                while src.pos < input.len() {
                    out.reserve(STEP);
                    let at = out.len();
                    let mut dst = OutBuffer::around_pos(out, at);
                    encoder.run(&mut src, &mut dst).map_err(CompressError::Zstd)?;
                }
                Ok(())
            }
        }
    }

    /// Appends to `out` everything pushed so far, compressed: the bytes
    /// written decode to all the input given, and the stream goes on. Call
    /// it when the backend has nothing more to read for now.
    pub fn flush(&mut self, out: &mut Vec<u8>) -> Result<(), CompressError> {
        match &mut self.inner {
            Inner::Gzip { deflate, header, .. } => {
                gzip_header(header, out);
                deflate_run(deflate, &[], out, FlushCompress::Sync)
            }
            Inner::Brotli(state) => brotli_run(state, BrotliEncoderOperation::BROTLI_OPERATION_FLUSH, &[], out),
            Inner::Zstd(encoder) => zstd_drain(out, |dst| encoder.flush(dst)),
        }
    }

    /// Ends the stream: appends the rest of the compressed bytes and the
    /// format's end (gzip's trailer, brotli's last block, zstd's frame end).
    pub fn finish(mut self, out: &mut Vec<u8>) -> Result<(), CompressError> {
        match &mut self.inner {
            Inner::Gzip { deflate, crc, header } => {
                gzip_header(header, out);
                deflate_run(deflate, &[], out, FlushCompress::Finish)?;
                out.extend_from_slice(&crc.sum().to_le_bytes());
                out.extend_from_slice(&crc.amount().to_le_bytes());
                Ok(())
            }
            Inner::Brotli(state) => brotli_run(state, BrotliEncoderOperation::BROTLI_OPERATION_FINISH, &[], out),
            Inner::Zstd(encoder) => zstd_drain(out, |dst| encoder.finish(dst, true)),
        }
    }
}

fn gzip_header(written: &mut bool, out: &mut Vec<u8>) {
    if !*written {
        out.extend_from_slice(&GZIP_HEADER);
        *written = true;
    }
}

/// Runs deflate over `input` with `flush` until all of it is taken and,
/// for a flush or the finish, all of its output written.
fn deflate_run(
    deflate: &mut Compress,
    input: &[u8],
    out: &mut Vec<u8>,
    flush: FlushCompress,
) -> Result<(), CompressError> {
    let mut taken = 0;
    loop {
        out.reserve(STEP);
        let room = out.capacity() - out.len();
        let before = (deflate.total_in(), out.len());
        let status = deflate.compress_vec(&input[taken..], out, flush).map_err(CompressError::Gzip)?;
        let used = usize::try_from(deflate.total_in() - before.0).unwrap_or(usize::MAX);
        taken = taken.saturating_add(used).min(input.len());
        let wrote = out.len() - before.1;
        let done = match flush {
            FlushCompress::Finish => status == flate2::Status::StreamEnd,
            // Everything pending is out when the output had room to spare.
            _ => taken == input.len() && wrote < room,
        };
        if done {
            return Ok(());
        }
        if used == 0 && wrote == 0 {
            // No progress with room to write: nothing is left to do (a
            // second flush with no new input).
            return Ok(());
        }
    }
}

/// Runs the brotli encoder with `op` over `input`, appending its output.
fn brotli_run(
    state: &mut BrotliEncoderStateStruct<StandardAlloc>,
    op: BrotliEncoderOperation,
    input: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), CompressError> {
    let mut nop = |_: &mut brotli::interface::PredictionModeContextMap<brotli::InputReferenceMut>,
                   _: &mut [brotli::interface::StaticCommand],
                   _: brotli::InputPair,
                   _: &mut StandardAlloc| ();
    let mut avail_in = input.len();
    let mut in_at = 0;
    loop {
        let start = out.len();
        out.resize(start + STEP, 0);
        let mut avail_out = STEP;
        let mut out_at = start;
        let ok = state.compress_stream(
            op,
            &mut avail_in,
            input,
            &mut in_at,
            &mut avail_out,
            out,
            &mut out_at,
            &mut None,
            &mut nop,
        );
        out.truncate(out_at);
        if !ok {
            return Err(CompressError::Brotli);
        }
        let done = match op {
            BrotliEncoderOperation::BROTLI_OPERATION_FINISH => state.is_finished(),
            BrotliEncoderOperation::BROTLI_OPERATION_FLUSH => !state.has_more_output(),
            _ => avail_in == 0,
        };
        if done {
            return Ok(());
        }
    }
}

/// Calls a zstd flush or end until it says nothing is left.
fn zstd_drain(
    out: &mut Vec<u8>,
    mut step: impl FnMut(&mut OutBuffer<'_, Vec<u8>>) -> io::Result<usize>,
) -> Result<(), CompressError> {
    loop {
        out.reserve(STEP);
        let at = out.len();
        let mut dst = OutBuffer::around_pos(out, at);
        if step(&mut dst).map_err(CompressError::Zstd)? == 0 {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    const ALL: [Algorithm; 3] = [Algorithm::Gzip, Algorithm::Br, Algorithm::Zstd];

    /// Decodes as much of `data` as it holds (a flushed prefix decodes
    /// to the input so far, then the stream just stops).
    fn decode(algorithm: Algorithm, data: &[u8]) -> Vec<u8> {
        let mut reader: Box<dyn Read + '_> = match algorithm {
            Algorithm::Gzip => Box::new(flate2::read::GzDecoder::new(data)),
            Algorithm::Br => Box::new(brotli::Decompressor::new(data, 4096)),
            Algorithm::Zstd => Box::new(zstd::stream::read::Decoder::new(data).expect("a decoder")),
        };
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// Decodes a finished stream, which must be complete and valid.
    fn decode_all(algorithm: Algorithm, data: &[u8]) -> Vec<u8> {
        let mut got = Vec::new();
        match algorithm {
            Algorithm::Gzip => flate2::read::GzDecoder::new(data).read_to_end(&mut got),
            Algorithm::Br => brotli::Decompressor::new(data, 4096).read_to_end(&mut got),
            Algorithm::Zstd => zstd::stream::read::Decoder::new(data).expect("a decoder").read_to_end(&mut got),
        }
        .expect("a complete stream");
        got
    }

    /// Text-like bytes that compress somewhat: a pseudo-random walk over
    /// a small alphabet, with repeats.
    fn sample(len: usize) -> Vec<u8> {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        (0..len)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if i % 97 < 40 {
                    b"{\"id\": 1, \"name\": \"tidegate\"}"[i % 29]
                } else {
                    b"abcdefghijklmnopqrstuvwxyz 0123456789"[(x % 37) as usize]
                }
            })
            .collect()
    }

    fn round_trip(algorithm: Algorithm, input: &[u8], pieces: &[usize]) {
        let mut c = Compressor::new(algorithm).expect("an encoder");
        assert_eq!(c.algorithm(), algorithm);
        let mut out = Vec::new();
        let mut at = 0;
        let mut i = 0;
        while at < input.len() {
            let n = pieces[i % pieces.len()].min(input.len() - at);
            c.push(&input[at..at + n], &mut out).expect("push");
            at += n;
            i += 1;
        }
        c.finish(&mut out).expect("finish");
        assert_eq!(decode_all(algorithm, &out), input, "{algorithm:?}, {} bytes", input.len());
    }

    #[test]
    fn every_algorithm_round_trips_byte_exact() {
        let big = sample(1 << 20);
        for a in ALL {
            round_trip(a, b"", &[1]);
            round_trip(a, b"x", &[1]);
            round_trip(a, &big, &[1, 7, 4096, 100_003, 13, 65_536]);
            round_trip(a, &big, &[1 << 20]);
            let mut out = Vec::new();
            Compressor::new(a).expect("an encoder").finish(&mut out).expect("finish");
            assert!(!out.is_empty(), "{a:?}: even an empty body is a stream");
        }
    }

    #[test]
    fn the_output_is_smaller_than_the_input() {
        let input = sample(200_000);
        for a in ALL {
            let mut c = Compressor::new(a).expect("an encoder");
            let mut out = Vec::new();
            c.push(&input, &mut out).expect("push");
            c.finish(&mut out).expect("finish");
            assert!(out.len() < input.len() / 2, "{a:?}: {} of {}", out.len(), input.len());
        }
    }

    #[test]
    fn each_flush_makes_everything_so_far_decodable() {
        let input = sample(300_000);
        for a in ALL {
            let mut c = Compressor::new(a).expect("an encoder");
            let mut out = Vec::new();
            let mut at = 0;
            for (i, n) in [1usize, 5, 17, 1000, 70_000, 3, 150_000].into_iter().enumerate() {
                c.push(&input[at..at + n], &mut out).expect("push");
                at += n;
                c.flush(&mut out).expect("flush");
                assert_eq!(decode(a, &out), &input[..at], "{a:?}, flush {i}");
                // A second flush with nothing new adds nothing to decode.
                c.flush(&mut out).expect("flush again");
                assert_eq!(decode(a, &out), &input[..at], "{a:?}, flush {i} again");
            }
            c.push(&input[at..], &mut out).expect("push");
            c.finish(&mut out).expect("finish");
            assert_eq!(decode_all(a, &out), input, "{a:?}");
        }
    }

    #[test]
    fn a_compressor_moves_between_threads() {
        // The engines hold one per response in tasks that may move.
        fn send<T: Send + 'static>(_: &T) {}
        send(&Compressor::new(Algorithm::Zstd).expect("an encoder"));
    }

    #[test]
    fn levels_are_brought_into_range() {
        let input = sample(10_000);
        for a in ALL {
            for level in [0, 1, 9, 11, 19, 22, u32::MAX] {
                let mut c = Compressor::with_level(a, level).expect("an encoder");
                let mut out = Vec::new();
                c.push(&input, &mut out).expect("push");
                c.finish(&mut out).expect("finish");
                assert_eq!(decode_all(a, &out), input, "{a:?} at {level}");
            }
        }
    }
}

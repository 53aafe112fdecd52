//! Read buffers, recycled within a worker, for client and upstream
//! connections alike.
//!
//! A connection holds a read buffer only while it has something to read:
//! an idle keep-alive connection, client or upstream, gives its buffer
//! back, so that idle connections cost no buffer memory; so does a request
//! waiting for its backend (its head is copied out, [`take_head`], and the
//! upstream connection takes a buffer only once the answer is there).
//! Allocating and freeing that 8 KiB twice per request cost about 650
//! instructions and 40 first-level instruction-cache misses per request
//! (callgrind, `bench/instructions.sh`), and the new memory is cold. So
//! each worker thread keeps the buffers its connections gave back, up to
//! [`KEPT`], and hands out the most recently returned one first (it is
//! likely still in the CPU's caches).

use std::cell::RefCell;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

/// How much a read asks for at least: a request head, or a response head
/// and a small body, fit in one read.
pub const READ_CHUNK: usize = 8 * 1024;

/// The most buffers one worker thread keeps for reuse (256 KiB).
const KEPT: usize = 32;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer with room for at least [`READ_CHUNK`] bytes.
pub fn take() -> BytesMut {
    FREE.try_with(|free| free.borrow_mut().pop()).ok().flatten().unwrap_or_else(|| BytesMut::with_capacity(READ_CHUNK))
}

/// Gives an empty connection's buffer back. It is kept for the next
/// [`take`] when its memory is exactly [`READ_CHUNK`] bytes that nothing
/// else still shares (a chunk split off it and not yet sent), and the
/// worker keeps fewer than [`KEPT`]; otherwise it is freed.
///
/// Only give back a buffer whose split-off chunks were all taken off its
/// front (`split_to`), as connections use their inbox.
pub fn give_back(mut buf: BytesMut) {
    debug_assert!(buf.is_empty(), "a buffer given back holds no unread bytes");
    if buf.capacity() == 0 {
        return;
    }
    buf.clear();
    // `try_reclaim` never allocates. Room for one byte more than
    // READ_CHUNK can be found only in memory that grew past it (a large
    // head or body was read), and such a buffer is freed. Then room for
    // READ_CHUNK can be found only when the memory is ours alone again:
    // its start moves back to the beginning of the memory. (A buffer
    // still shared has less than READ_CHUNK of room left, since what was
    // split off its front came out of the same READ_CHUNK.)
    if buf.try_reclaim(READ_CHUNK + 1) || !buf.try_reclaim(READ_CHUNK) {
        return;
    }
    let _ = FREE.try_with(|free| {
        let mut free = free.borrow_mut();
        if free.len() < KEPT {
            free.push(buf);
        }
    });
}

/// Takes the first `len` bytes of `inbox` (a request head) off it, to
/// keep for the whole request. When the inbox holds nothing else (no body
/// yet, no next request), they are copied out and the read buffer goes
/// back to the worker at once: a request waiting for its backend holds its
/// head's few hundred bytes, not a read buffer, and the next read gets the
/// buffer while it is still in the caches. Otherwise the head is split
/// off, sharing the buffer with what follows it.
pub fn take_head(inbox: &mut BytesMut, len: usize) -> BytesMut {
    if inbox.len() != len {
        return inbox.split_to(len);
    }
    let head = BytesMut::from(&inbox[..]);
    inbox.clear();
    give_back(std::mem::take(inbox));
    head
}

/// Reads at least one byte from `stream` into `inbox`; `Ok(0)` is the end
/// of the stream.
pub async fn fill<R: AsyncRead + Unpin>(stream: &mut R, inbox: &mut BytesMut) -> std::io::Result<usize> {
    if inbox.capacity() == 0 {
        *inbox = take();
    } else if inbox.capacity() - inbox.len() < READ_CHUNK / 4 {
        inbox.reserve(READ_CHUNK.max(inbox.len()));
    }
    stream.read_buf(inbox).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> usize {
        FREE.with(|f| f.borrow().len())
    }

    #[test]
    fn a_buffer_given_back_is_the_next_one_taken() {
        let mut a = take();
        let start = a.as_ptr();
        a.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        let head = a.split_to(a.len());
        drop(head);
        give_back(a);
        assert_eq!(kept(), 1);
        let b = take();
        assert_eq!(kept(), 0);
        assert!(b.is_empty());
        assert!(b.capacity() >= READ_CHUNK);
        assert_eq!(b.as_ptr(), start, "the same memory, from its start");
    }

    #[test]
    fn a_buffer_still_shared_is_not_kept() {
        FREE.with(|f| f.borrow_mut().clear());
        let mut a = take();
        a.extend_from_slice(b"body");
        let chunk = a.split_to(4).freeze();
        give_back(a);
        assert_eq!(kept(), 0, "its memory is still the chunk's");
        assert_eq!(&chunk[..], b"body");
    }

    #[test]
    fn a_large_buffer_with_a_small_window_left_is_freed() {
        FREE.with(|f| f.borrow_mut().clear());
        // A 64 KiB head read and consumed: the window left looks small.
        let mut a = BytesMut::with_capacity(64 * 1024);
        a.extend_from_slice(&[b'x'; 50 * 1024]);
        drop(a.split_to(a.len()));
        assert!(a.capacity() <= 2 * READ_CHUNK);
        give_back(a);
        assert_eq!(kept(), 0, "its memory is 64 KiB");
    }

    #[test]
    fn a_read_through_buffer_is_kept_and_a_grown_one_is_not() {
        use bytes::Buf;
        FREE.with(|f| f.borrow_mut().clear());
        let mut a = BytesMut::with_capacity(READ_CHUNK);
        a.extend_from_slice(&[b'x'; 100]);
        a.advance(100);
        give_back(a);
        assert_eq!(kept(), 1);
        let mut grown = BytesMut::with_capacity(READ_CHUNK);
        grown.extend_from_slice(&[b'x'; READ_CHUNK]);
        grown.reserve(1);
        grown.advance(READ_CHUNK);
        give_back(grown);
        assert_eq!(kept(), 1, "its memory grew past READ_CHUNK");
    }

    #[test]
    fn a_lone_head_is_copied_out_and_its_buffer_given_back() {
        FREE.with(|f| f.borrow_mut().clear());
        let mut inbox = take();
        let start = inbox.as_ptr();
        inbox.extend_from_slice(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
        let len = inbox.len();
        let head = take_head(&mut inbox, len);
        assert_eq!(&head[..], b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
        assert_eq!(head.capacity(), len, "the copy is the head's size");
        assert_eq!(inbox.capacity(), 0, "the connection holds no buffer");
        assert_eq!(kept(), 1);
        assert_eq!(take().as_ptr(), start, "the next read gets the same buffer");
    }

    #[test]
    fn a_head_with_bytes_after_it_is_split_off() {
        FREE.with(|f| f.borrow_mut().clear());
        let mut inbox = take();
        inbox.extend_from_slice(b"POST / HTTP/1.1\r\ncontent-length: 2\r\n\r\nhi");
        let len = inbox.len() - 2;
        let head = take_head(&mut inbox, len);
        assert!(head.ends_with(b"\r\n\r\n"));
        assert_eq!(&inbox[..], b"hi", "the body stays in the inbox");
        assert_eq!(kept(), 0);
    }

    #[test]
    fn large_buffers_and_more_than_kept_are_freed() {
        FREE.with(|f| f.borrow_mut().clear());
        give_back(BytesMut::with_capacity(64 * 1024));
        assert_eq!(kept(), 0);
        give_back(BytesMut::new());
        assert_eq!(kept(), 0);
        for _ in 0..KEPT + 5 {
            give_back(BytesMut::with_capacity(READ_CHUNK));
        }
        assert_eq!(kept(), KEPT);
    }
}

//! Reading the PROXY protocol header a trusted balancer puts before a
//! connection's bytes ([`tidegate_proxy_protocol`] parses it). Only the
//! header's own bytes are taken from the socket: what is peeked and found
//! to be all header is read, and the client's first bytes after it stay
//! for the TLS handshake or the HTTP parser.

use std::net::SocketAddr;

use tidegate_proxy_protocol::{Header, Parsed, MAX_V2};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Why a connection from a trusted balancer was closed before its first
/// request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HeaderError {
    /// The bytes are not a PROXY protocol header.
    #[error(transparent)]
    Malformed(#[from] tidegate_proxy_protocol::Error),
    /// The balancer closed the connection within the header.
    #[error("the connection ended within the PROXY protocol header")]
    Ended,
    /// Reading failed.
    #[error("reading the PROXY protocol header: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads the header at the start of `stream`: the client it names and the
/// address that client connected to, or None when it names none (a
/// `LOCAL` or `UNKNOWN` header: the connection's own addresses stand).
pub(crate) async fn read(stream: &mut TcpStream) -> Result<Option<(SocketAddr, SocketAddr)>, HeaderError> {
    // Bytes already read: all of them the header's.
    let mut head: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; MAX_V2];
    loop {
        let room = MAX_V2 - head.len();
        let n = stream.peek(&mut buf[..room.max(1)]).await?;
        if n == 0 {
            return Err(HeaderError::Ended);
        }
        let seen: std::borrow::Cow<[u8]> = if head.is_empty() {
            std::borrow::Cow::Borrowed(&buf[..n])
        } else {
            std::borrow::Cow::Owned([&head[..], &buf[..n]].concat())
        };
        match tidegate_proxy_protocol::parse(&seen)? {
            Parsed::Header { header, len } => {
                let rest = len - head.len();
                stream.read_exact(&mut buf[..rest]).await?;
                return Ok(match header {
                    Header::Proxied { source, destination } => Some((source, destination)),
                    Header::Local => None,
                });
            }
            // Everything peeked is the header's: take it, and wait for
            // the rest (a peek would return the same bytes at once).
            Parsed::Incomplete => {
                if head.len() + n >= MAX_V2 {
                    return Err(tidegate_proxy_protocol::Error::TooLong.into());
                }
                stream.read_exact(&mut buf[..n]).await?;
                head.extend_from_slice(&buf[..n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    #[tokio::test]
    async fn the_header_is_taken_and_the_clients_bytes_are_left_even_when_it_comes_in_pieces() {
        let (mut balancer, mut server) = pair().await;
        let send = tokio::spawn(async move {
            for piece in [&b"PRO"[..], b"XY TCP4 192.0.2.1 ", b"198.51.100.2 5000 80\r", b"\nGET / HTTP/1.1\r\n\r\n"] {
                balancer.write_all(piece).await.unwrap();
                balancer.flush().await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            balancer
        });
        let client = read(&mut server).await.unwrap();
        assert_eq!(client, Some(("192.0.2.1:5000".parse().unwrap(), "198.51.100.2:80".parse().unwrap())));
        let _balancer = send.await.unwrap();
        let mut rest = [0u8; 18];
        server.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"GET / HTTP/1.1\r\n\r\n");
    }

    #[tokio::test]
    async fn a_local_header_names_no_client_and_anything_else_is_refused() {
        let (mut balancer, mut server) = pair().await;
        let mut local = tidegate_proxy_protocol::V2_SIGNATURE.to_vec();
        local.extend_from_slice(&[0x20, 0x00, 0, 0]);
        balancer.write_all(&local).await.unwrap();
        assert_eq!(read(&mut server).await.unwrap(), None);

        let (mut client, mut server) = pair().await;
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert!(matches!(read(&mut server).await, Err(HeaderError::Malformed(_))));

        let (mut balancer, mut server) = pair().await;
        balancer.write_all(b"PROXY TCP4 192.0.2.1").await.unwrap();
        drop(balancer);
        assert!(matches!(read(&mut server).await, Err(HeaderError::Ended)));
    }
}

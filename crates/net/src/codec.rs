//! The `/nuwa/sync/1` codec: opaque length-prefixed frames with a hard size
//! cap checked before a body is buffered.

use std::io;

use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::StreamProtocol;
use libp2p::request_response;
use nuwa_counters::Counters;

use crate::NetCount;

/// Length-prefixed opaque frames with a size cap.
#[derive(Debug, Clone)]
pub(crate) struct FrameCodec {
    pub(crate) max_frame_bytes: usize,
    /// Where inbound frames refused for size are counted. libp2p drops a
    /// failed inbound read without an event, so the codec counts them itself.
    pub(crate) counters: Counters<NetCount>,
}

/// Responses are short receipts.
pub(crate) const MAX_RESPONSE_BYTES: usize = 4096;

pub(crate) async fn read_frame<T>(io: &mut T, max: usize) -> io::Result<Vec<u8>>
where
    T: futures::AsyncRead + Unpin + Send,
{
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the cap of {max} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    io.read_exact(&mut body).await?;
    Ok(body)
}

async fn write_frame<T>(io: &mut T, body: &[u8], max: usize) -> io::Result<()>
where
    T: futures::AsyncWrite + Unpin + Send,
{
    if body.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "frame of {} bytes exceeds the cap of {max} bytes",
                body.len()
            ),
        ));
    }
    io.write_all(&(body.len() as u32).to_be_bytes()).await?;
    io.write_all(body).await?;
    io.close().await
}

impl request_response::Codec for FrameCodec {
    type Protocol = StreamProtocol;
    type Request = Vec<u8>;
    type Response = Vec<u8>;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Vec<u8>>
    where
        T: futures::AsyncRead + Unpin + Send,
    {
        let r = read_frame(io, self.max_frame_bytes).await;
        if matches!(&r, Err(e) if e.kind() == io::ErrorKind::InvalidData) {
            self.counters.inc(NetCount::OversizedFramesRefused);
        }
        r
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Vec<u8>>
    where
        T: futures::AsyncRead + Unpin + Send,
    {
        read_frame(io, MAX_RESPONSE_BYTES).await
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: Vec<u8>,
    ) -> io::Result<()>
    where
        T: futures::AsyncWrite + Unpin + Send,
    {
        write_frame(io, &req, self.max_frame_bytes).await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: Vec<u8>,
    ) -> io::Result<()>
    where
        T: futures::AsyncWrite + Unpin + Send,
    {
        write_frame(io, &res, MAX_RESPONSE_BYTES).await
    }
}

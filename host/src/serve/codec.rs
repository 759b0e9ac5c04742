//! The gRPC codec of Berth's own services: prost's, except that a message
//! that does not decode is the sender's mistake (INVALID_ARGUMENT), not an
//! internal error of the receiver (tonic's prost codec answers INTERNAL).

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec as TonicCodec, DecodeBuf, Decoder};
use tonic::{Code, Status};
use tonic_prost::prost::Message;
use tonic_prost::{ProstDecoder, ProstEncoder};

pub struct Codec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(PhantomData)
    }
}

impl<T, U> TonicCodec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(ProstDecoder::default())
    }
}

/// prost's decoder with its parse errors answered as INVALID_ARGUMENT.
pub struct CheckedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| match s.code() {
            Code::Internal => Status::invalid_argument(format!("not a valid protobuf message: {}", s.message())),
            _ => s,
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

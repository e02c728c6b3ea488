//! Switchyard's gRPC API (`switchyard.v1`): the generated messages and services, and the one
//! module that converts them to and from the domain types of `switchyard-shared`
//! ([`convert`]). Protobuf types stop at the edge: the gRPC edges call [`convert`], nothing
//! past them sees a message.

pub mod convert;

#[allow(clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("switchyard.v1");

    /// Encoded `FileDescriptorSet` of the API, served by gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("switchyard_descriptor");
}

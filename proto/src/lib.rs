//! Generated types of Switchyard's gRPC API (`switchyard.v1`).
//!
//! Protobuf types stop at the edge: the other crates convert them to domain types in one
//! module each (`switchyard_shared::pb`).

#![allow(clippy::all, clippy::pedantic)]

pub mod v1 {
    tonic::include_proto!("switchyard.v1");

    /// Encoded `FileDescriptorSet` of the API, served by gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("switchyard_descriptor");
}

use super::*;

#[test]
fn peer_memory_is_remote_read_only_and_landing_memory_local_write_only() {
    assert_eq!(
        access_for(MemoryRole::PeerStaging),
        Access {
            local_write: false,
            remote_read: true,
            remote_write: false,
            remote_atomic: false,
        }
    );
    assert_eq!(
        access_for(MemoryRole::EngineLanding),
        Access {
            local_write: true,
            remote_read: false,
            remote_write: false,
            remote_atomic: false,
        }
    );
}

#[test]
fn completion_codes_round_trip() {
    for (code, status) in WcStatus::KNOWN.iter().enumerate() {
        assert_eq!(WcStatus::from_code(code as u32), *status);
        assert_eq!(status.code(), code as u32);
    }
    assert_eq!(WcStatus::from_code(999), WcStatus::Unknown(999));
    assert_eq!(WcStatus::Unknown(999).code(), 999);
}

#[test]
fn only_failed_completions_are_errors() {
    assert!(VerbsError::completion(1, WcStatus::Success, 0).is_none());
    let err = VerbsError::completion(7, WcStatus::RemoteAccess, 0x32).unwrap();
    assert!(matches!(
        err,
        VerbsError::Completion {
            wr_id: 7,
            status: WcStatus::RemoteAccess,
            vendor_err: 0x32
        }
    ));
    assert!(err.to_string().contains("RemoteAccess"));
}

#[test]
fn failed_calls_carry_their_errno() {
    let err = VerbsError::call("ibv_reg_mr", 12);
    match err {
        VerbsError::Call { call, source } => {
            assert_eq!(call, "ibv_reg_mr");
            assert_eq!(source.raw_os_error(), Some(12));
        }
        other => panic!("{other}"),
    }
}

/// The codes above are the library's own: checked against the bindings.
#[cfg(feature = "ibverbs")]
#[test]
fn completion_codes_match_the_bindings() {
    use ibverbs_sys::ibv_wc_status as s;
    let pairs = [
        (s::IBV_WC_SUCCESS, WcStatus::Success),
        (s::IBV_WC_LOC_LEN_ERR, WcStatus::LocalLength),
        (s::IBV_WC_LOC_QP_OP_ERR, WcStatus::LocalQpOperation),
        (s::IBV_WC_LOC_EEC_OP_ERR, WcStatus::LocalEecOperation),
        (s::IBV_WC_LOC_PROT_ERR, WcStatus::LocalProtection),
        (s::IBV_WC_WR_FLUSH_ERR, WcStatus::Flushed),
        (s::IBV_WC_MW_BIND_ERR, WcStatus::MemoryWindowBind),
        (s::IBV_WC_BAD_RESP_ERR, WcStatus::BadResponse),
        (s::IBV_WC_LOC_ACCESS_ERR, WcStatus::LocalAccess),
        (s::IBV_WC_REM_INV_REQ_ERR, WcStatus::RemoteInvalidRequest),
        (s::IBV_WC_REM_ACCESS_ERR, WcStatus::RemoteAccess),
        (s::IBV_WC_REM_OP_ERR, WcStatus::RemoteOperation),
        (s::IBV_WC_RETRY_EXC_ERR, WcStatus::RetryExceeded),
        (s::IBV_WC_RNR_RETRY_EXC_ERR, WcStatus::RnrRetryExceeded),
        (s::IBV_WC_LOC_RDD_VIOL_ERR, WcStatus::LocalRddViolation),
        (s::IBV_WC_REM_INV_RD_REQ_ERR, WcStatus::RemoteInvalidRdRequest),
        (s::IBV_WC_REM_ABORT_ERR, WcStatus::RemoteAborted),
        (s::IBV_WC_INV_EECN_ERR, WcStatus::InvalidEecn),
        (s::IBV_WC_INV_EEC_STATE_ERR, WcStatus::InvalidEecState),
        (s::IBV_WC_FATAL_ERR, WcStatus::Fatal),
        (s::IBV_WC_RESP_TIMEOUT_ERR, WcStatus::ResponseTimeout),
        (s::IBV_WC_GENERAL_ERR, WcStatus::General),
        (s::IBV_WC_TM_ERR, WcStatus::TagMatching),
        (s::IBV_WC_TM_RNDV_INCOMPLETE, WcStatus::TagMatchingRendezvous),
    ];
    assert_eq!(pairs.len(), WcStatus::KNOWN.len());
    for (code, status) in pairs {
        assert_eq!(WcStatus::from_code(code), status);
    }
}

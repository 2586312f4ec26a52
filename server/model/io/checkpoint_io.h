// Umbrella header for torch-free checkpoint I/O: dtypes, tensor views, safetensors and torch.save
// zip readers/writers, and ReadCheckpointFile (dispatch on content).
#ifndef COLLABSERVE_SERVER_MODEL_IO_CHECKPOINT_IO_H_
#define COLLABSERVE_SERVER_MODEL_IO_CHECKPOINT_IO_H_

#include "server/model/io/checkpoint.h"    // IWYU pragma: export
#include "server/model/io/dtype.h"         // IWYU pragma: export
#include "server/model/io/safetensors.h"   // IWYU pragma: export
#include "server/model/io/torch_zip.h"     // IWYU pragma: export

#endif  // COLLABSERVE_SERVER_MODEL_IO_CHECKPOINT_IO_H_

// TensorRT IPluginV3 "DhsRowCopy": host->device gather copy of missing rows into the KV arena, in place.
#pragma once

#include "../common/plugin_base.h"

namespace dhisparse
{
namespace trt
{

//! Inputs: 0 arena [rows, row_bytes] uint8 (updated in place), 1 host_address [1] int64 (device-accessible
//! address of the pinned host store), 2 src_rows [R, M] int32 (host row, -1 = none), 3 dst_rows [R, M] int32.
//! Output: 0 arena, aliased to input 0 (IPluginV3OneBuildV2::getAliasedInput).
//! Field: row_bytes (int32 > 0, must equal the arena's second dimension).
class RowCopyPlugin : public PluginBase<RowCopyPlugin, nvinfer1::IPluginV3OneBuildV2>
{
public:
    static constexpr char const* kName = "DhsRowCopy";
    static constexpr char const* kVersion = "1";
    static constexpr int32_t kNbInputs = 4;
    static constexpr int32_t kNbOutputs = 1;

    explicit RowCopyPlugin(int32_t row_bytes);
    RowCopyPlugin(RowCopyPlugin const&) = default;

    static RowCopyPlugin create(nvinfer1::PluginFieldCollection const* fc);
    static void describe_fields(FieldList& fields);
    void list_fields(FieldList& fields) const;

    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

private:
    int32_t mRowBytes;
};

} // namespace trt
} // namespace dhisparse
